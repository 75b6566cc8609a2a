"""`mm-adaptor convert hf-to-mcore` in the test's own process (its command line is tests/convert's): a fresh
interpreter costs 6-7 s of CPU importing torch, transformers and megatron-core again."""


def convert_in_process(hf, mcore) -> None:
    from mm_adaptor.cli import main

    assert main(["convert", "hf-to-mcore", str(hf), str(mcore)]) == 0
