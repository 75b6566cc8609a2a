"""Test helpers: the transformers reference model, prompts and images, and HF weights cut into our local shards
(a stand-in until the converter's mapping lands)."""

from __future__ import annotations

import numpy as np
from hf_compat import hf_takes_token_types, token_types, with_token_types  # noqa: F401  (callers import them here)
import torch

from mm_adaptor.models.qwen2_5_vl import Qwen25VLConfig, tiny_hf_config_dict

IMAGE_SIZES = [(140, 200), (168, 112)]  # (height, width): non-square, several windows each


def hf_model(config: Qwen25VLConfig, seed: int = 0):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    hf_config = Qwen2_5_VLConfig(**tiny_hf_config_dict(config))
    hf_config._attn_implementation = "eager"
    model = Qwen2_5_VLForConditionalGeneration(hf_config).eval()
    with torch.no_grad():  # HF zero-initialises biases and ones norms: make every weight count
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def hf_inputs(config: Qwen25VLConfig, input_ids: torch.Tensor, **inputs) -> dict:
    """Keyword arguments of the transformers model's forward/generate: input_ids and `inputs`, with the token types
    where the installed transformers needs them (5.x)."""
    return {"input_ids": input_ids, **with_token_types(config, input_ids, **inputs)}


def hf_image_features(model, pixels, grid) -> torch.Tensor:
    """The merged vision embeddings of all images: 4.x's get_image_features returns them per image, 5.x an output
    object holding them (pooler_output)."""
    features = model.model.get_image_features(pixels, grid)
    return torch.cat(list(getattr(features, "pooler_output", features)))


def images(sizes=IMAGE_SIZES, seed: int = 1):
    from PIL import Image
    from hf_compat import slow_qwen2_vl_image_processor

    Qwen2VLImageProcessor = slow_qwen2_vl_image_processor()

    rng = np.random.default_rng(seed)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    out = Qwen2VLImageProcessor()(images=pictures, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def prompt(config: Qwen25VLConfig, grid_thw=None, text_lengths=(5, 4, 3), seed: int = 2) -> torch.Tensor:
    """[1, s]: text, then per image vision-start + pads + vision-end and more text; s even (sequence parallel)."""
    gen = torch.Generator().manual_seed(seed)
    pieces = [torch.randint(0, config.image_token_id - 10, (text_lengths[0],), generator=gen)]
    merge = config.spatial_merge_size**2
    for i, (t, h, w) in enumerate([] if grid_thw is None else grid_thw.tolist()):
        pads = torch.full((t * h * w // merge,), config.image_token_id)
        pieces += [torch.tensor([config.vision_start_token_id]), pads, torch.tensor([config.vision_start_token_id + 1]),
                   torch.randint(0, config.image_token_id - 10, (text_lengths[1 + i % 2],), generator=gen)]
    ids = torch.cat(pieces)
    if len(ids) % 2:
        ids = torch.cat([ids, ids[:1]])
    return ids.unsqueeze(0)


def _rows(tensor, rank, size, dim=0):
    return tensor.chunk(size, dim=dim)[rank]


def _grouped_qkv(q, k, v, groups):
    """[q of group, k, v] per group, as megatron's SelfAttention expects (also for biases)."""
    tail = q.shape[1:]
    q = q.reshape(groups, -1, *tail)
    k = k.reshape(groups, -1, *tail)
    v = v.reshape(groups, -1, *tail)
    return torch.cat([q, k, v], dim=1)


def megatron_shard(hf_state: dict, model, config: Qwen25VLConfig, tp_rank: int, tp_size: int) -> dict:
    """Our model's local state dict (this TP rank, this pipeline stage) from an HF state dict (in-memory names)."""
    hf = {k.replace("model.visual.", "visual.").replace("model.language_model.", "model."): v
          for k, v in hf_state.items()}
    out = {}

    def fc1(gate, up):
        return torch.cat([_rows(gate, tp_rank, tp_size), _rows(up, tp_rank, tp_size)])

    if model.pre_process:
        hid = config.vision_hidden_size
        out["vision_model.patch_embed.proj.weight"] = hf["visual.patch_embed.proj.weight"].reshape(hid, -1)
        for i in range(config.vision_depth):
            src, dst = f"visual.blocks.{i}.", f"vision_model.decoder.layers.{i}."
            heads = config.vision_num_heads
            for kind in ("weight", "bias"):
                q, k, v = hf[src + f"attn.qkv.{kind}"].chunk(3)
                qkv = _grouped_qkv(q, k, v, heads)
                out[dst + f"self_attention.linear_qkv.{kind}"] = _rows(qkv, tp_rank, tp_size).reshape(-1, *q.shape[1:])
                out[dst + f"mlp.linear_fc1.{kind}"] = fc1(hf[src + f"mlp.gate_proj.{kind}"],
                                                          hf[src + f"mlp.up_proj.{kind}"])
            out[dst + "self_attention.linear_proj.weight"] = _rows(hf[src + "attn.proj.weight"], tp_rank, tp_size, 1)
            out[dst + "self_attention.linear_proj.bias"] = hf[src + "attn.proj.bias"]
            out[dst + "mlp.linear_fc2.weight"] = _rows(hf[src + "mlp.down_proj.weight"], tp_rank, tp_size, 1)
            out[dst + "mlp.linear_fc2.bias"] = hf[src + "mlp.down_proj.bias"]
            out[dst + "input_layernorm.weight"] = hf[src + "norm1.weight"]
            out[dst + "pre_mlp_layernorm.weight"] = hf[src + "norm2.weight"]
        out["vision_projection.layernorm.weight"] = hf["visual.merger.ln_q.weight"]
        out["vision_projection.encoder.linear_fc1.weight"] = _rows(hf["visual.merger.mlp.0.weight"], tp_rank, tp_size)
        out["vision_projection.encoder.linear_fc1.bias"] = _rows(hf["visual.merger.mlp.0.bias"], tp_rank, tp_size)
        out["vision_projection.encoder.linear_fc2.weight"] = _rows(hf["visual.merger.mlp.2.weight"],
                                                                   tp_rank, tp_size, 1)
        out["vision_projection.encoder.linear_fc2.bias"] = hf["visual.merger.mlp.2.bias"]
        out["language_model.embedding.word_embeddings.weight"] = _rows(hf["model.embed_tokens.weight"], tp_rank,
                                                                       tp_size)
    lm = model.language_model
    for local, layer in enumerate(lm.decoder.layers):
        src, dst = f"model.layers.{layer.layer_number - 1}.", f"language_model.decoder.layers.{local}."
        for kind in ("weight", "bias"):
            qkv = _grouped_qkv(*(hf[src + f"self_attn.{p}_proj.{kind}"] for p in "qkv"), config.num_query_groups)
            out[dst + f"self_attention.linear_qkv.{kind}"] = _rows(qkv, tp_rank, tp_size).reshape(
                -1, *qkv.shape[2:])
        out[dst + "self_attention.linear_proj.weight"] = _rows(hf[src + "self_attn.o_proj.weight"], tp_rank, tp_size, 1)
        out[dst + "mlp.linear_fc1.weight"] = fc1(hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"])
        out[dst + "mlp.linear_fc2.weight"] = _rows(hf[src + "mlp.down_proj.weight"], tp_rank, tp_size, 1)
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
    if model.post_process:
        out["language_model.decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        out["language_model.output_layer.weight"] = _rows(hf["lm_head.weight"], tp_rank, tp_size)
    return out


def load_hf_weights(model, hf_state: dict, config: Qwen25VLConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
    shard = megatron_shard(hf_state, model, config, tp_rank, tp_size)
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert set(own) == set(shard), f"missing {set(own) - set(shard)}, unexpected {set(shard) - set(own)}"
    for key, value in shard.items():
        assert own[key].shape == value.shape, f"{key}: {tuple(own[key].shape)} vs {tuple(value.shape)}"
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in shard.items()}, strict=False)
