"""Vision-language models built from megatron-core modules, one package per family."""
