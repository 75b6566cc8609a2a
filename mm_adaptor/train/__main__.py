import sys

from mm_adaptor.cli import run

run(["train", *sys.argv[1:]])
