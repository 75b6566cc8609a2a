"""Qwen3-VL and Qwen3-VL-MoE: Hugging Face names (as transformers 4.57 and 5.x save them: `model.visual.*`,
`model.language_model.*`, `lm_head.weight`) <-> the Megatron model's names.

`family(config)` takes the HF config (a dict as in config.json, or a transformers config object) and returns the
converter's rules.Family: one rule per Megatron tensor, `{i}` a layer of the "vit" or "llm" stack. A MoE model's
dense MLP rules cover the layers of the "llm_dense" subset, its router and expert rules those of "llm_moe"; an
expert's rules say `{e}` (stacks["experts"] of them) and name transformers' per-expert tensors
(`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`). transformers saves a layer's experts fused
(`mlp.experts.gate_up_proj` and `mlp.experts.down_proj`: 4.57 as (E, H, 2I) and (E, I, H), 5.x transposed); the
converter splits and fuses those (rules.FusedExperts, the Family's default)."""

from __future__ import annotations

import math

from mm_adaptor.convert.rules import Family, Rule
from mm_adaptor.models.hf_config import config_dict, model_type


def dims(config) -> dict:
    """The sizes the rules and the checks need, from the HF config (read by config_from_hf, which refuses what we
    cannot build)."""
    from mm_adaptor.models.qwen3_vl.config import config_from_hf

    c = config_from_hf(config_dict(config))
    pattern = c.moe_layer_pattern
    return {
        "llm_layers": c.num_layers, "llm_hidden": c.hidden_size, "llm_heads": c.num_attention_heads,
        "llm_groups": c.num_query_groups, "llm_head_dim": c.head_dim,
        "vit_layers": c.vision_depth, "vit_hidden": c.vision_hidden_size, "vit_heads": c.vision_num_heads,
        "vit_groups": c.vision_num_heads, "vit_head_dim": c.vision_hidden_size // c.vision_num_heads,
        "kernel": (c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size),
        "deepstack": len(c.deepstack_visual_indexes), "vocab": c.vocab_size, "tied": c.tie_word_embeddings,
        "experts": c.num_experts, "expert_hidden": c.moe_intermediate_size,
        "moe_layers": tuple(i for i, sparse in enumerate(pattern) if sparse),
        "dense_layers": tuple(i for i, sparse in enumerate(pattern) if not sparse),
    }


def family(config) -> Family:
    d = dims(config)
    vit, llm = "vision_model.decoder.layers.{i}.", "language_model.decoder.layers.{i}."
    blk, lyr = "model.visual.blocks.{i}.", "model.language_model.layers.{i}."
    moe = bool(d["moe_layers"])
    dense_stack = "llm_dense" if moe else "llm"
    vit_qkv = (d["vit_heads"], d["vit_groups"], d["vit_head_dim"])
    llm_qkv = (d["llm_heads"], d["llm_groups"], d["llm_head_dim"])
    rules = [
        Rule("vision_model.patch_embed.proj.weight", ("model.visual.patch_embed.proj.weight",), "reshape",
             shape=(d["vit_hidden"], math.prod(d["kernel"])), hf_shape=(d["vit_hidden"], *d["kernel"])),
        Rule("vision_model.patch_embed.proj.bias", ("model.visual.patch_embed.proj.bias",)),
        Rule("vision_model.pos_embed.weight", ("model.visual.pos_embed.weight",)),
    ]
    mergers = [("vision_projection.", "model.visual.merger.")] + [
        (f"deepstack_projections.{k}.", f"model.visual.deepstack_merger_list.{k}.") for k in range(d["deepstack"])]
    for suffix in ("weight", "bias"):
        rules += [
            Rule(f"{vit}self_attention.linear_qkv.{suffix}", (f"{blk}attn.qkv.{suffix}",), "qkv_fused", "vit", vit_qkv),
            Rule(f"{vit}self_attention.linear_proj.{suffix}", (f"{blk}attn.proj.{suffix}",), stack="vit"),
            Rule(f"{vit}mlp.linear_fc1.{suffix}", (f"{blk}mlp.linear_fc1.{suffix}",), stack="vit"),
            Rule(f"{vit}mlp.linear_fc2.{suffix}", (f"{blk}mlp.linear_fc2.{suffix}",), stack="vit"),
            Rule(f"{vit}input_layernorm.{suffix}", (f"{blk}norm1.{suffix}",), stack="vit"),
            Rule(f"{vit}pre_mlp_layernorm.{suffix}", (f"{blk}norm2.{suffix}",), stack="vit"),
        ]
        for ours, theirs in mergers:
            rules += [Rule(f"{ours}layernorm.{suffix}", (f"{theirs}norm.{suffix}",)),
                      Rule(f"{ours}encoder.linear_fc1.{suffix}", (f"{theirs}linear_fc1.{suffix}",)),
                      Rule(f"{ours}encoder.linear_fc2.{suffix}", (f"{theirs}linear_fc2.{suffix}",))]
    rules += [
        Rule("language_model.embedding.word_embeddings.weight", ("model.language_model.embed_tokens.weight",)),
        Rule(f"{llm}input_layernorm.weight", (f"{lyr}input_layernorm.weight",), stack="llm"),
        Rule(f"{llm}self_attention.linear_qkv.weight",
             tuple(f"{lyr}self_attn.{p}_proj.weight" for p in "qkv"), "qkv", "llm", llm_qkv),
        Rule(f"{llm}self_attention.q_layernorm.weight", (f"{lyr}self_attn.q_norm.weight",), stack="llm"),
        Rule(f"{llm}self_attention.k_layernorm.weight", (f"{lyr}self_attn.k_norm.weight",), stack="llm"),
        Rule(f"{llm}self_attention.linear_proj.weight", (f"{lyr}self_attn.o_proj.weight",), stack="llm"),
        Rule(f"{llm}pre_mlp_layernorm.weight", (f"{lyr}post_attention_layernorm.weight",), stack="llm"),
        Rule("language_model.decoder.final_layernorm.weight", ("model.language_model.norm.weight",)),
    ]
    if d["dense_layers"]:
        rules += [
            Rule(f"{llm}mlp.linear_fc1.weight", (f"{lyr}mlp.gate_proj.weight", f"{lyr}mlp.up_proj.weight"), "cat",
                 dense_stack),
            Rule(f"{llm}mlp.linear_fc2.weight", (f"{lyr}mlp.down_proj.weight",), stack=dense_stack),
        ]
    if moe:
        expert, hf_expert = f"{llm}mlp.experts.local_experts.{{e}}.", f"{lyr}mlp.experts.{{e}}."
        rules += [
            Rule(f"{llm}mlp.router.weight", (f"{lyr}mlp.gate.weight",), stack="llm_moe"),
            Rule(f"{expert}linear_fc1.weight", (f"{hf_expert}gate_proj.weight", f"{hf_expert}up_proj.weight"), "cat",
                 "llm_moe"),
            Rule(f"{expert}linear_fc2.weight", (f"{hf_expert}down_proj.weight",), stack="llm_moe"),
        ]
    if not d["tied"]:
        rules.append(Rule("language_model.output_layer.weight", ("lm_head.weight",)))
    linears = ("self_attention.linear_qkv", "self_attention.linear_proj")
    extra = {f"{vit}{name}._extra_state": "vit" for name in (*linears, "mlp.linear_fc1", "mlp.linear_fc2")}
    extra.update({f"{llm}{name}._extra_state": "llm" for name in linears})
    if d["dense_layers"]:
        extra.update({f"{llm}mlp.{name}._extra_state": dense_stack for name in ("linear_fc1", "linear_fc2")})
    if moe:
        extra.update({f"{llm}mlp.experts.local_experts.{{e}}.{name}._extra_state": "llm_moe"
                      for name in ("linear_fc1", "linear_fc2")})
    extra.update({f"{ours}encoder.{name}._extra_state": None for ours, _ in mergers
                  for name in ("linear_fc1", "linear_fc2")})
    extra["language_model.output_layer._extra_state"] = None  # tied or not, the output layer is a linear module
    stacks = {"vit": d["vit_layers"], "llm": d["llm_layers"]}
    subsets = {}
    if moe:
        stacks.update(llm_dense=d["llm_layers"], llm_moe=d["llm_layers"], experts=d["experts"])
        subsets = {"llm_dense": d["dense_layers"], "llm_moe": d["moe_layers"]}
    return Family(name=model_type(config), rules=rules, stacks=stacks, subsets=subsets,
                  ignored_hf={"lm_head.weight"} if d["tied"] else set(), extra_states=extra,
                  config=config_dict(config))
