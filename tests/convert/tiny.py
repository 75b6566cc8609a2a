"""A seeded tiny Qwen2.5-VL made by transformers from a config object, saved as an HF directory."""

from __future__ import annotations

import json


def tiny_config(tie: bool = False, **text):
    from transformers import Qwen2_5_VLConfig

    text = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 96, "vocab_size": 160, "tie_word_embeddings": tie,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, **text}
    vision = {"depth": 2, "hidden_size": 32, "num_heads": 4, "intermediate_size": 48, "out_hidden_size": 64,
              "fullatt_block_indexes": [1], "window_size": 56}
    return Qwen2_5_VLConfig(vision_config=vision, text_config=text)


def save_tiny(path, tie: bool = False, seed: int = 0, max_shard_size="40KB", **text) -> dict:
    """Saves the model (several shards) and tokenizer-like side files; returns its saved tensors."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(tie, **text))
    with torch.no_grad():  # norms and biases away from their constant initial values
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    (path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14}))
    tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors
