"""A test-only MoE family: a GPT language model whose every layer is a MoE layer (megatron's GPTModel, local spec,
SequentialMLP), its HF names in transformers' style, experts written with `{e}`; seeded synthetic HF tensors in the
three forms experts come in. Every layer alike, megatron saves the layers as one stack: keys with a layer and an
expert axis (Qwen3-VL-MoE's layer pattern list makes megatron key each layer apart instead)."""

from __future__ import annotations

import json

import torch

from mm_adaptor.convert.rules import Family, Rule

SIZES = dict(layers=2, experts=4, hidden=32, heads=4, groups=2, inner=24, vocab=64)


def family(config: dict, layout: str | None = None, writing: bool = False) -> Family:
    """checkpoint_family's stand-in (one layout: layout and writing change nothing)."""
    s = {**SIZES, **config.get("sizes", {})}
    head_dim = s["hidden"] // s["heads"]
    llm, lyr = "language_model.decoder.layers.{i}.", "model.layers.{i}."
    expert, hf_expert = f"{llm}mlp.experts.local_experts.{{e}}.", f"{lyr}mlp.experts.{{e}}."
    rules = [
        Rule("language_model.embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
        Rule(f"{llm}input_layernorm.weight", (f"{lyr}input_layernorm.weight",), stack="llm"),
        Rule(f"{llm}self_attention.linear_qkv.weight", tuple(f"{lyr}self_attn.{p}_proj.weight" for p in "qkv"),
             "qkv", "llm", (s["heads"], s["groups"], head_dim)),
        Rule(f"{llm}self_attention.q_layernorm.weight", (f"{lyr}self_attn.q_norm.weight",), stack="llm"),
        Rule(f"{llm}self_attention.k_layernorm.weight", (f"{lyr}self_attn.k_norm.weight",), stack="llm"),
        Rule(f"{llm}self_attention.linear_proj.weight", (f"{lyr}self_attn.o_proj.weight",), stack="llm"),
        Rule(f"{llm}pre_mlp_layernorm.weight", (f"{lyr}post_attention_layernorm.weight",), stack="llm"),
        Rule(f"{llm}mlp.router.weight", (f"{lyr}mlp.gate.weight",), stack="llm"),
        Rule(f"{expert}linear_fc1.weight", (f"{hf_expert}gate_proj.weight", f"{hf_expert}up_proj.weight"), "cat",
             "llm"),
        Rule(f"{expert}linear_fc2.weight", (f"{hf_expert}down_proj.weight",), stack="llm"),
        Rule("language_model.decoder.final_layernorm.weight", ("model.norm.weight",)),
        Rule("language_model.output_layer.weight", ("lm_head.weight",)),
    ]
    extra = {f"{llm}self_attention.{name}._extra_state": "llm" for name in ("linear_qkv", "linear_proj")}
    extra.update({f"{expert}{name}._extra_state": "llm" for name in ("linear_fc1", "linear_fc2")})
    return Family(name="tiny_moe", rules=rules, stacks={"llm": s["layers"], "experts": s["experts"]},
                  extra_states=extra, config=config, per_layer_keys=tuple(config.get("per_layer_keys", ())))


def dims(config: dict) -> dict:
    s = {**SIZES, **config.get("sizes", {})}
    return {"llm_layers": s["layers"], "llm_heads": s["heads"], "llm_groups": s["groups"], "vit_layers": 0,
            "vit_heads": 1, "vit_groups": 1}


def per_expert_tensors(seed: int = 0, **sizes) -> dict:
    """HF tensors with one gate/up/down set per expert (Linear weights)."""
    s = {**SIZES, **sizes}
    h, d, inner = s["hidden"], s["hidden"] // s["heads"], s["inner"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    out = {"model.embed_tokens.weight": rand(s["vocab"], h), "model.norm.weight": rand(h),
           "lm_head.weight": rand(s["vocab"], h)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": rand(h), p + "post_attention_layernorm.weight": rand(h),
                    p + "self_attn.q_proj.weight": rand(s["heads"] * d, h),
                    p + "self_attn.k_proj.weight": rand(s["groups"] * d, h),
                    p + "self_attn.v_proj.weight": rand(s["groups"] * d, h),
                    p + "self_attn.o_proj.weight": rand(h, s["heads"] * d),
                    p + "self_attn.q_norm.weight": rand(d), p + "self_attn.k_norm.weight": rand(d),
                    p + "mlp.gate.weight": rand(s["experts"], h)})
        for e in range(s["experts"]):
            out.update({f"{p}mlp.experts.{e}.gate_proj.weight": rand(inner, h),
                        f"{p}mlp.experts.{e}.up_proj.weight": rand(inner, h),
                        f"{p}mlp.experts.{e}.down_proj.weight": rand(h, inner)})
    return out


def in_form(tensors: dict, form: str, **sizes) -> dict:
    """The tensors with experts "per_expert", or fused as transformers 4.x ("fused_4") or 5.x ("fused_5") saves
    them."""
    from mm_adaptor.convert import fuse

    if form == "per_expert":
        return dict(tensors)
    return fuse(family({"sizes": sizes}), tensors, 4 if form == "fused_4" else 5)


def save(path, tensors: dict, version: str, shards: int = 3, **sizes) -> None:
    """config.json (transformers_version, sizes) and the tensors in `shards` safetensors files with an index."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "tiny_moe", "transformers_version": version,
                                                  "sizes": sizes}))
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name].contiguous() for name in names[k::shards]}
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def megatron_model(**sizes):
    """megatron's GPTModel of these sizes: every layer MoE (moe_layer_freq 1), SequentialMLP experts."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    s = {**SIZES, **sizes}
    config = TransformerConfig(
        num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
        num_query_groups=s["groups"], ffn_hidden_size=2 * s["inner"], moe_ffn_hidden_size=s["inner"],
        num_moe_experts=s["experts"], moe_router_topk=2, moe_token_dispatcher_type="allgather", moe_layer_freq=1,
        gated_linear_unit=True, normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False,
        use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(num_experts=s["experts"], moe_grouped_gemm=False, normalization="RMSNorm",
                                    qk_layernorm=True)
    return GPTModel(config, spec, vocab_size=s["vocab"], max_sequence_length=32, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)
