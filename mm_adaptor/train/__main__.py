import sys

from mm_adaptor.train import main

sys.exit(main())
