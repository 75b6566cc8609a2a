"""Qwen2.5-VL: Hugging Face names (as transformers 4.57 saves them) <-> the Megatron model's names.

`family(config)` takes the HF config (a dict as in config.json, or a transformers config object) and returns the
converter's rules.Family: one rule per Megatron tensor, `{i}` a layer of the "vit" or "llm" stack."""

from __future__ import annotations

import math

from mm_adaptor.convert.rules import Family, Rule
from mm_adaptor.models.hf_config import config_dict, text_config, tied, vision_config


def dims(config) -> dict:
    """The sizes the rules and the checks need, from the HF config."""
    text, vision = text_config(config), vision_config(config)
    heads, hidden = text["num_attention_heads"], text["hidden_size"]
    vit_hidden, vit_heads = vision["hidden_size"], vision["num_heads"]
    kernel = (vision.get("in_channels", 3), vision.get("temporal_patch_size", 2), vision.get("patch_size", 14),
              vision.get("patch_size", 14))
    return {
        "llm_layers": text["num_hidden_layers"], "llm_hidden": hidden, "llm_heads": heads,
        "llm_groups": text.get("num_key_value_heads") or heads, "llm_head_dim": hidden // heads,
        "vit_layers": vision["depth"], "vit_hidden": vit_hidden, "vit_heads": vit_heads,
        "vit_groups": vit_heads, "vit_head_dim": vit_hidden // vit_heads, "kernel": kernel,
        "vocab": text["vocab_size"], "tied": tied(config),
    }


def family(config) -> Family:
    d = dims(config)
    vit, llm = "vision_model.decoder.layers.{i}.", "language_model.decoder.layers.{i}."
    blk, lyr = "visual.blocks.{i}.", "model.layers.{i}."
    vit_qkv = (d["vit_heads"], d["vit_groups"], d["vit_head_dim"])
    llm_qkv = (d["llm_heads"], d["llm_groups"], d["llm_head_dim"])
    rules = [Rule("vision_model.patch_embed.proj.weight", ("visual.patch_embed.proj.weight",), "reshape",
                  shape=(d["vit_hidden"], math.prod(d["kernel"])), hf_shape=(d["vit_hidden"], *d["kernel"]))]
    for suffix in ("weight", "bias"):
        rules += [
            Rule(f"{vit}self_attention.linear_qkv.{suffix}", (f"{blk}attn.qkv.{suffix}",), "qkv_fused", "vit", vit_qkv),
            Rule(f"{vit}self_attention.linear_proj.{suffix}", (f"{blk}attn.proj.{suffix}",), stack="vit"),
            Rule(f"{vit}mlp.linear_fc1.{suffix}", (f"{blk}mlp.gate_proj.{suffix}", f"{blk}mlp.up_proj.{suffix}"),
                 "cat", "vit"),
            Rule(f"{vit}mlp.linear_fc2.{suffix}", (f"{blk}mlp.down_proj.{suffix}",), stack="vit"),
            Rule(f"vision_projection.encoder.linear_fc1.{suffix}", (f"visual.merger.mlp.0.{suffix}",)),
            Rule(f"vision_projection.encoder.linear_fc2.{suffix}", (f"visual.merger.mlp.2.{suffix}",)),
        ]
    rules += [
        Rule(f"{vit}input_layernorm.weight", (f"{blk}norm1.weight",), stack="vit"),
        Rule(f"{vit}pre_mlp_layernorm.weight", (f"{blk}norm2.weight",), stack="vit"),
        Rule("vision_projection.layernorm.weight", ("visual.merger.ln_q.weight",)),
        Rule("language_model.embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
        Rule(f"{llm}input_layernorm.weight", (f"{lyr}input_layernorm.weight",), stack="llm"),
        Rule(f"{llm}self_attention.linear_qkv.weight",
             tuple(f"{lyr}self_attn.{p}_proj.weight" for p in "qkv"), "qkv", "llm", llm_qkv),
        Rule(f"{llm}self_attention.linear_qkv.bias",
             tuple(f"{lyr}self_attn.{p}_proj.bias" for p in "qkv"), "qkv", "llm", llm_qkv),
        Rule(f"{llm}self_attention.linear_proj.weight", (f"{lyr}self_attn.o_proj.weight",), stack="llm"),
        Rule(f"{llm}pre_mlp_layernorm.weight", (f"{lyr}post_attention_layernorm.weight",), stack="llm"),
        Rule(f"{llm}mlp.linear_fc1.weight", (f"{lyr}mlp.gate_proj.weight", f"{lyr}mlp.up_proj.weight"), "cat", "llm"),
        Rule(f"{llm}mlp.linear_fc2.weight", (f"{lyr}mlp.down_proj.weight",), stack="llm"),
        Rule("language_model.decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    if not d["tied"]:
        rules.append(Rule("language_model.output_layer.weight", ("lm_head.weight",)))
    extra = {f"{tower}{name}._extra_state": stack for tower, stack in ((vit, "vit"), (llm, "llm"))
             for name in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                          "mlp.linear_fc2")}
    extra.update({f"vision_projection.encoder.{name}._extra_state": None for name in ("linear_fc1", "linear_fc2")})
    return Family(
        name="qwen2_5_vl", rules=rules, stacks={"vit": d["vit_layers"], "llm": d["llm_layers"]},
        ignored_hf={"lm_head.weight"} if d["tied"] else set(), extra_states=extra,
        hf_aliases={"model.visual.": "visual.", "model.language_model.": "model."}, config=config_dict(config),
    )
