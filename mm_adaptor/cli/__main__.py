import sys

from mm_adaptor.cli import main

sys.exit(main())
