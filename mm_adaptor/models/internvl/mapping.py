"""InternVL: Hugging Face names <-> the Megatron model's names, for both checkpoint layouts.

- transformers-native (`model_type` "internvl"): `vision_tower.*`, `multi_modal_projector.*`, `language_model.model.*`
  and `language_model.lm_head.weight`, what save_pretrained writes (4.57 and 5.x alike: 5.x reverts its in-memory
  names on save) and the released `-hf` checkpoints hold; the in-memory names (`model.vision_tower.*`,
  `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.weight`) are accepted on input as aliases.
  The vision attention is q/k/v apart.
- OpenGVLab (`model_type` "internvl_chat"): `vision_model.embeddings.*`, `vision_model.encoder.layers.N.*` (fused
  `attn.qkv`, `ls1`/`ls2`, `norm1`/`norm2`), `mlp1.{0,1,3}`, `language_model.model.*`, `language_model.lm_head`.

`family(config)` returns the converter's rules.Family; `original_family(config)` the OpenGVLab layout's for the
same model (what `mcore-to-hf --layout original` writes)."""

from __future__ import annotations

from mm_adaptor.convert.rules import Family, Rule
from mm_adaptor.models.hf_config import config_dict

LAYOUTS = ("native", "original")  # the first is what mcore-to-hf writes by default
# in memory -> saved
NATIVE_ALIASES = {"model.language_model.": "language_model.model.", "lm_head.": "language_model.lm_head.",
                  "model.vision_tower.": "vision_tower.", "model.multi_modal_projector.": "multi_modal_projector."}


def dims(config) -> dict:
    """The sizes the rules and the checks need, from the HF config (read by config_from_hf, which refuses what we
    cannot build)."""
    from mm_adaptor.models.internvl.config import config_from_hf

    c = config_from_hf(config_dict(config))
    return {
        "llm_layers": c.num_layers, "llm_hidden": c.hidden_size, "llm_heads": c.num_attention_heads,
        "llm_groups": c.num_query_groups, "llm_head_dim": c.kv_channels, "qwen3": c.language_model_type == "qwen3",
        "vit_layers": c.vision_depth, "vit_hidden": c.vision_hidden_size, "vit_heads": c.vision_num_heads,
        "vit_groups": c.vision_num_heads, "vit_head_dim": c.vision_hidden_size // c.vision_num_heads,
        "vit_qkv_bias": c.vision_qkv_bias, "vit_qk_norm": c.vision_qk_norm,
        "vit_norm_bias": c.vision_norm == "layer_norm", "vocab": c.vocab_size, "tied": c.tie_word_embeddings,
    }


def _names(layout: str) -> dict:
    """Each layout's HF names of the pieces the rules join (`{i}` a layer)."""
    if layout == "original":
        blk = "vision_model.encoder.layers.{i}."
        return {"cls": "vision_model.embeddings.class_embedding", "pos": "vision_model.embeddings.position_embedding",
                "patch": "vision_model.embeddings.patch_embedding.", "qkv": (f"{blk}attn.qkv.",),
                "proj": f"{blk}attn.proj.", "q_norm": f"{blk}attn.q_norm.", "k_norm": f"{blk}attn.k_norm.",
                "ls1": f"{blk}ls1", "ls2": f"{blk}ls2", "norm1": f"{blk}norm1.", "norm2": f"{blk}norm2.",
                "fc1": f"{blk}mlp.fc1.", "fc2": f"{blk}mlp.fc2.", "mm_norm": "mlp1.0.", "mm_fc1": "mlp1.1.",
                "mm_fc2": "mlp1.3.", "llm": "language_model.model.", "lm_head": "language_model.lm_head.weight"}
    vt, blk = "vision_tower.", "vision_tower.encoder.layer.{i}."
    return {"cls": f"{vt}embeddings.cls_token", "pos": f"{vt}embeddings.position_embeddings",
            "patch": f"{vt}embeddings.patch_embeddings.projection.",
            "qkv": tuple(f"{blk}attention.{p}_proj." for p in "qkv"), "proj": f"{blk}attention.projection_layer.",
            "q_norm": f"{blk}attention.q_norm.", "k_norm": f"{blk}attention.k_norm.", "ls1": f"{blk}lambda_1",
            "ls2": f"{blk}lambda_2", "norm1": f"{blk}layernorm_before.", "norm2": f"{blk}layernorm_after.",
            "fc1": f"{blk}mlp.fc1.", "fc2": f"{blk}mlp.fc2.", "mm_norm": "multi_modal_projector.layer_norm.",
            "mm_fc1": "multi_modal_projector.linear_1.", "mm_fc2": "multi_modal_projector.linear_2.",
            "llm": "language_model.model.", "lm_head": "language_model.lm_head.weight"}


def family(config, layout: str | None = None) -> Family:
    """The rules of the config's own layout, or of `layout` ("native" | "original") for the same model; the
    Family's config is then that layout's config.json."""
    from mm_adaptor.models.internvl.config import ORIGINAL, config_from_hf, layout_of, original_config_dict
    from mm_adaptor.models.internvl.config import tiny_hf_config_dict as native_config_dict

    cfg = config_dict(config)
    own = "original" if layout_of(cfg) == ORIGINAL else "native"
    layout = layout or own
    if layout != own:
        model = config_from_hf(cfg)
        cfg = original_config_dict(model) if layout == "original" else {
            **native_config_dict(model), "architectures": ["InternVLForConditionalGeneration"]}
    d, n = dims(cfg), _names(layout)
    vit, llm = "vision_model.decoder.layers.{i}.", "language_model.decoder.layers.{i}."
    vit_qkv = (d["vit_heads"], d["vit_groups"], d["vit_head_dim"])
    llm_qkv = (d["llm_heads"], d["llm_groups"], d["llm_head_dim"])
    qkv_op = "qkv_fused" if layout == "original" else "qkv"
    rules = [
        Rule("vision_model.class_token", (n["cls"],)),
        Rule("vision_model.position_embeddings", (n["pos"],)),
        Rule(f"{vit}self_attention.linear_proj.layer_scale", (n["ls1"],), stack="vit"),
        Rule(f"{vit}mlp.linear_fc2.layer_scale", (n["ls2"],), stack="vit"),
    ]
    for suffix in ("weight", "bias"):
        rules += [
            Rule(f"vision_model.patch_embed.{suffix}", (n["patch"] + suffix,)),
            Rule(f"{vit}self_attention.linear_proj.{suffix}", (n["proj"] + suffix,), stack="vit"),
            Rule(f"{vit}mlp.linear_fc1.{suffix}", (n["fc1"] + suffix,), stack="vit"),
            Rule(f"{vit}mlp.linear_fc2.{suffix}", (n["fc2"] + suffix,), stack="vit"),
            Rule(f"vision_projection.layernorm.{suffix}", (n["mm_norm"] + suffix,)),
            Rule(f"vision_projection.encoder.linear_fc1.{suffix}", (n["mm_fc1"] + suffix,)),
            Rule(f"vision_projection.encoder.linear_fc2.{suffix}", (n["mm_fc2"] + suffix,)),
        ]
        if suffix == "weight" or d["vit_qkv_bias"]:
            rules.append(Rule(f"{vit}self_attention.linear_qkv.{suffix}", tuple(p + suffix for p in n["qkv"]), qkv_op,
                              "vit", vit_qkv))
        if suffix == "weight" or d["vit_norm_bias"]:
            rules += [Rule(f"{vit}input_layernorm.{suffix}", (n["norm1"] + suffix,), stack="vit"),
                      Rule(f"{vit}pre_mlp_layernorm.{suffix}", (n["norm2"] + suffix,), stack="vit")]
    if d["vit_qk_norm"]:
        rules += [Rule(f"{vit}self_attention.q_layernorm.weight", (n["q_norm"] + "weight",), stack="vit"),
                  Rule(f"{vit}self_attention.k_layernorm.weight", (n["k_norm"] + "weight",), stack="vit")]
    rules += language_rules(n["llm"], llm_qkv, d["qwen3"])
    if not d["tied"]:
        rules.append(Rule("language_model.output_layer.weight", (n["lm_head"],)))
    linears = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    extra = {f"{tower}{name}._extra_state": stack for tower, stack in ((vit, "vit"), (llm, "llm")) for name in linears}
    extra.update({f"vision_projection.encoder.{name}._extra_state": None for name in ("linear_fc1", "linear_fc2")})
    extra["language_model.output_layer._extra_state"] = None
    return Family(
        name="internvl" if layout == "native" else "internvl_chat", rules=rules,
        stacks={"vit": d["vit_layers"], "llm": d["llm_layers"]}, ignored_hf={n["lm_head"]} if d["tied"] else set(),
        extra_states=extra, hf_aliases=NATIVE_ALIASES if layout == "native" else {}, config=cfg,
    )


def language_rules(top: str, qkv: tuple[int, int, int], qwen3: bool) -> list[Rule]:
    """A Qwen2 (qkv bias) or Qwen3 (q/k norm) decoder under `top` (`language_model.model.`)."""
    llm, lyr = "language_model.decoder.layers.{i}.", top + "layers.{i}."
    rules = [
        Rule("language_model.embedding.word_embeddings.weight", (f"{top}embed_tokens.weight",)),
        Rule(f"{llm}input_layernorm.weight", (f"{lyr}input_layernorm.weight",), stack="llm"),
        Rule(f"{llm}self_attention.linear_qkv.weight", tuple(f"{lyr}self_attn.{p}_proj.weight" for p in "qkv"), "qkv",
             "llm", qkv),
        Rule(f"{llm}self_attention.linear_proj.weight", (f"{lyr}self_attn.o_proj.weight",), stack="llm"),
        Rule(f"{llm}pre_mlp_layernorm.weight", (f"{lyr}post_attention_layernorm.weight",), stack="llm"),
        Rule(f"{llm}mlp.linear_fc1.weight", (f"{lyr}mlp.gate_proj.weight", f"{lyr}mlp.up_proj.weight"), "cat", "llm"),
        Rule(f"{llm}mlp.linear_fc2.weight", (f"{lyr}mlp.down_proj.weight",), stack="llm"),
        Rule("language_model.decoder.final_layernorm.weight", (f"{top}norm.weight",)),
    ]
    if qwen3:
        rules += [Rule(f"{llm}self_attention.q_layernorm.weight", (f"{lyr}self_attn.q_norm.weight",), stack="llm"),
                  Rule(f"{llm}self_attention.k_layernorm.weight", (f"{lyr}self_attn.k_norm.weight",), stack="llm")]
    else:
        rules.append(Rule(f"{llm}self_attention.linear_qkv.bias", tuple(f"{lyr}self_attn.{p}_proj.bias" for p in "qkv"),
                          "qkv", "llm", qkv))
    return rules
