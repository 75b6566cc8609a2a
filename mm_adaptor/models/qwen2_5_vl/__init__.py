"""Qwen2.5-VL on megatron-core: vision encoder with window attention, patch merger, GPTModel with mrope."""
