"""Qwen2.5-VL's shape as one dataclass (read from an HF config dict), and megatron TransformerConfigs for its towers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mm_adaptor.models.megatron_config import activation, common_fields, uneven_stages


@dataclass
class Qwen25VLConfig:
    # vision tower
    vision_depth: int = 32
    vision_hidden_size: int = 1280
    vision_ffn_hidden_size: int = 3420
    vision_num_heads: int = 16
    vision_hidden_act: str = "silu"
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    tokens_per_second: int = 2
    # language model
    vocab_size: int = 152064
    hidden_size: int = 3584
    ffn_hidden_size: int = 18944
    num_layers: int = 28
    num_attention_heads: int = 28
    num_query_groups: int = 4
    norm_epsilon: float = 1e-6
    rope_theta: float = 1000000.0
    mrope_section: tuple[int, ...] = (16, 24, 24)
    max_position_embeddings: int = 128000
    tie_word_embeddings: bool = False
    # special tokens
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    # parallelism and precision
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # language layers per pipeline stage, e.g. [1, 3]; None: even split
    pipeline_layers: list[int] | None = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1  # the language model's; the vision tower runs on whole images
    params_dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    transformer_impl: str = "local"  # "local" | "transformer_engine"
    extra: dict = field(default_factory=dict)  # further TransformerConfig fields for both towers

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def config_from_hf(hf_config: dict, **overrides) -> Qwen25VLConfig:
    """From an HF Qwen2.5-VL config dict (config.json, or Qwen2_5_VLConfig.to_dict()) as transformers 4.x or 5.x
    saves it (models/hf_config.py)."""
    from mm_adaptor.models import hf_config as hf

    text, vision = hf.text_config(hf_config), hf_config["vision_config"]
    rope = hf.rope(hf_config, default_theta=1000000.0)
    if rope.mrope_section is None:
        raise ValueError(f"the HF config has no {rope.spelling}.mrope_section; Qwen2.5-VL needs it")
    kv_heads = text.get("num_key_value_heads") or text["num_attention_heads"]
    config = Qwen25VLConfig(
        vision_depth=vision["depth"],
        vision_hidden_size=vision["hidden_size"],
        vision_ffn_hidden_size=vision["intermediate_size"],
        vision_num_heads=vision["num_heads"],
        vision_hidden_act=vision.get("hidden_act", "silu"),
        patch_size=vision.get("patch_size", 14),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        window_size=vision.get("window_size", 112),
        fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", ())),
        tokens_per_second=vision.get("tokens_per_second", 2),
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        ffn_hidden_size=text["intermediate_size"],
        num_layers=text["num_hidden_layers"],
        num_attention_heads=text["num_attention_heads"],
        num_query_groups=kv_heads,
        norm_epsilon=text.get("rms_norm_eps", 1e-6),
        rope_theta=rope.theta,
        mrope_section=rope.mrope_section,
        max_position_embeddings=text.get("max_position_embeddings", 128000),
        tie_word_embeddings=hf.tied(hf_config),
        image_token_id=hf_config.get("image_token_id", 151655),
        video_token_id=hf_config.get("video_token_id", 151656),
        vision_start_token_id=hf_config.get("vision_start_token_id", 151652),
    )
    out_hidden = vision.get("out_hidden_size", config.hidden_size)
    if out_hidden != config.hidden_size:
        raise ValueError(f"vision out_hidden_size {out_hidden} != language hidden_size {config.hidden_size}")
    return dataclasses.replace(config, **overrides)


def tiny_config(**overrides) -> Qwen25VLConfig:
    """A few-MB model for tests and --model qwen2_5_vl-tiny: 2 vision layers (the second full attention, the first
    in windows), GQA language model with 4 layers, untied output layer."""
    config = Qwen25VLConfig(
        vision_depth=2, vision_hidden_size=64, vision_ffn_hidden_size=96, vision_num_heads=4,
        fullatt_block_indexes=(1,), window_size=112, tokens_per_second=2,
        vocab_size=512, hidden_size=64, ffn_hidden_size=128, num_layers=4, num_attention_heads=4,
        num_query_groups=2, norm_epsilon=1e-6, rope_theta=10000.0, mrope_section=(2, 3, 3),
        max_position_embeddings=2048, tie_word_embeddings=False,
        image_token_id=500, video_token_id=501, vision_start_token_id=502,
    )
    return dataclasses.replace(config, **overrides)


def tiny_hf_config_dict(config: Qwen25VLConfig | None = None) -> dict:
    """The HF config dict of a Qwen25VLConfig (inverse of config_from_hf), e.g. to build a reference model."""
    c = config or tiny_config()
    return {
        "model_type": "qwen2_5_vl",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.ffn_hidden_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_query_groups, "rms_norm_eps": c.norm_epsilon, "rope_theta": c.rope_theta,
        "rope_scaling": {"type": "mrope", "mrope_section": list(c.mrope_section)},
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "image_token_id": c.image_token_id, "video_token_id": c.video_token_id,
        "vision_start_token_id": c.vision_start_token_id, "vision_end_token_id": c.vision_start_token_id + 1,
        "vision_config": {
            "depth": c.vision_depth, "hidden_size": c.vision_hidden_size, "intermediate_size": c.vision_ffn_hidden_size,
            "num_heads": c.vision_num_heads, "hidden_act": c.vision_hidden_act, "patch_size": c.patch_size,
            "temporal_patch_size": c.temporal_patch_size, "in_channels": c.in_channels,
            "spatial_merge_size": c.spatial_merge_size, "window_size": c.window_size,
            "fullatt_block_indexes": list(c.fullatt_block_indexes), "tokens_per_second": c.tokens_per_second,
            "out_hidden_size": c.hidden_size,
        },
    }


def vision_transformer_config(c: Qwen25VLConfig):
    """The vision tower's layers: bidirectional, biased qkv/proj/SwiGLU, no pipeline split, no SP."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=c.vision_depth, hidden_size=c.vision_hidden_size, ffn_hidden_size=c.vision_ffn_hidden_size,
        num_attention_heads=c.vision_num_heads, kv_channels=c.vision_hidden_size // c.vision_num_heads,
        layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=activation(c.vision_hidden_act),
        add_bias_linear=True, add_qkv_bias=True, pipeline_model_parallel_size=1, sequence_parallel=False,
        **common_fields(c, "RMSNorm"),
    )


def projection_config(c: Qwen25VLConfig):
    """The patch merger's MLP: 4 * vision hidden -> GELU (exact) -> language hidden."""
    from megatron.core.transformer import TransformerConfig
    import torch.nn.functional as F

    merged = c.vision_hidden_size * c.spatial_merge_size**2
    return TransformerConfig(
        num_layers=1, hidden_size=c.hidden_size, ffn_hidden_size=merged, num_attention_heads=c.vision_num_heads,
        layernorm_epsilon=1e-6, gated_linear_unit=False, activation_func=F.gelu, add_bias_linear=True,
        pipeline_model_parallel_size=1, sequence_parallel=False, **common_fields(c, "RMSNorm"),
    )


def language_transformer_config(c: Qwen25VLConfig):
    """Qwen2 decoder: GQA with qkv bias, no other biases, SwiGLU, RMSNorm, mrope; uneven pipeline splits."""
    from megatron.core.transformer import TransformerConfig

    kwargs = uneven_stages(c)
    return TransformerConfig(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups,
        kv_channels=c.hidden_size // c.num_attention_heads, layernorm_epsilon=c.norm_epsilon,
        gated_linear_unit=True, activation_func=activation("silu"), add_bias_linear=False, add_qkv_bias=True,
        mrope_section=list(c.mrope_section), pipeline_model_parallel_size=c.pipeline_model_parallel_size,
        sequence_parallel=c.sequence_parallel, context_parallel_size=c.context_parallel_size, **kwargs,
        **common_fields(c, "RMSNorm"),
    )
