from mm_adaptor.cli import run

run()
