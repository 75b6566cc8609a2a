"""The real Qwen2.5-VL 3B/7B/72B configs (values from their config.json) map every key to the right shape, on the
meta device: the HF model built by transformers, its tensors through the rules, the shapes compared with the ones
Megatron's modules have under the same sizes."""

import pytest
import torch

VISION = {"depth": 32, "hidden_size": 1280, "hidden_act": "silu", "intermediate_size": 3420, "num_heads": 16,
          "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
          "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2}
CONFIGS = {
    "3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, tie_word_embeddings=True, out_hidden_size=2048, tp=2),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False, out_hidden_size=3584, tp=4),
    "72B": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, tie_word_embeddings=False, out_hidden_size=8192, tp=8),
}


def hub_config(values: dict) -> dict:
    """config.json as on the hub: text values at the top level, the vision config beside them."""
    values = dict(values)
    values.pop("tp")
    return {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 128000,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "hidden_act": "silu", "torch_dtype": "bfloat16", **values,
            "vision_config": {**VISION, "out_hidden_size": values.pop("out_hidden_size")}}


def megatron_shapes(v: dict, layers: int, vit_layers: int) -> dict:
    """Per-layer shapes of megatron's modules: fused qkv rows are heads + 2 key/value groups of head_dim."""
    h, heads, kv, ffn = v["hidden_size"], v["num_attention_heads"], v["num_key_value_heads"], v["intermediate_size"]
    vh, vffn, out = VISION["hidden_size"], VISION["intermediate_size"], v["out_hidden_size"]
    merged = vh * VISION["spatial_merge_size"] ** 2
    shapes = {"vision_model.patch_embed.proj.weight": (vh, 3 * 2 * 14 * 14),
              "vision_projection.layernorm.weight": (vh,),
              "vision_projection.encoder.linear_fc1.weight": (merged, merged),
              "vision_projection.encoder.linear_fc1.bias": (merged,),
              "vision_projection.encoder.linear_fc2.weight": (out, merged),
              "vision_projection.encoder.linear_fc2.bias": (out,),
              "language_model.embedding.word_embeddings.weight": (151936, h),
              "language_model.decoder.final_layernorm.weight": (h,)}
    if not v["tie_word_embeddings"]:
        shapes["language_model.output_layer.weight"] = (151936, h)
    qkv = h + 2 * kv * (h // heads)
    for i in range(vit_layers):
        p = f"vision_model.decoder.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (vh,), p + "pre_mlp_layernorm.weight": (vh,),
                       p + "self_attention.linear_qkv.weight": (3 * vh, vh),
                       p + "self_attention.linear_qkv.bias": (3 * vh,),
                       p + "self_attention.linear_proj.weight": (vh, vh), p + "self_attention.linear_proj.bias": (vh,),
                       p + "mlp.linear_fc1.weight": (2 * vffn, vh), p + "mlp.linear_fc1.bias": (2 * vffn,),
                       p + "mlp.linear_fc2.weight": (vh, vffn), p + "mlp.linear_fc2.bias": (vh,)})
    for i in range(layers):
        p = f"language_model.decoder.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,),
                       p + "self_attention.linear_qkv.weight": (qkv, h), p + "self_attention.linear_qkv.bias": (qkv,),
                       p + "self_attention.linear_proj.weight": (h, h),
                       p + "mlp.linear_fc1.weight": (2 * ffn, h), p + "mlp.linear_fc2.weight": (h, ffn)})
    return shapes


@pytest.mark.parametrize("size", list(CONFIGS))
def test_real_config_maps_every_key(size):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mm_adaptor.convert import family_for, hf_to_mcore_tensors, mcore_to_hf_tensors
    from mm_adaptor.convert.layout import validate
    from mm_adaptor.models.qwen2_5_vl.mapping import dims

    values = CONFIGS[size]
    config = hub_config(values)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig.from_dict(config))
    is_tied = model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert is_tied == values["tie_word_embeddings"]
    hf = dict(model.state_dict())  # the in-memory names (model.visual.*, model.language_model.*)
    family = family_for(config)
    mcore = hf_to_mcore_tensors(family, hf)
    expected = megatron_shapes(values, values["num_hidden_layers"], VISION["depth"])
    assert {name: tuple(t.shape) for name, t in mcore.items()} == expected
    back = mcore_to_hf_tensors(family, mcore)
    legacy = {name.replace("model.language_model.", "model.").replace("model.visual.", "visual."): tuple(t.shape)
              for name, t in hf.items() if not (is_tied and name == "lm_head.weight")}
    assert {name: tuple(t.shape) for name, t in back.items()} == legacy
    # the layouts these sizes train with are accepted
    d = dims(config)
    layers = values["num_hidden_layers"]
    layout = validate(d, values["tp"], [[layers // 2, layers - layers // 2]], [[32, 0]])
    assert layout.pp == 2
