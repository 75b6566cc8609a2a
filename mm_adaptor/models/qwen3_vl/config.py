"""Qwen3-VL and Qwen3-VL-MoE as one dataclass (read from an HF config dict), and megatron TransformerConfigs for
their towers. `num_experts == 0` is the dense model (model_type qwen3_vl), above it the MoE one (qwen3_vl_moe)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mm_adaptor.models.megatron_config import ACTIVATIONS, activation, common_fields, stage_split, uneven_stages

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


@dataclass
class Qwen3VLConfig:
    # vision tower
    vision_depth: int = 27
    vision_hidden_size: int = 1152
    vision_ffn_hidden_size: int = 4304
    vision_num_heads: int = 16
    vision_hidden_act: str = "gelu_pytorch_tanh"
    patch_size: int = 16
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304  # a square grid of learned positions, interpolated to each image
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    vision_rope_theta: float = 10000.0
    # language model
    vocab_size: int = 151936
    hidden_size: int = 4096
    ffn_hidden_size: int = 12288  # the dense MLPs' (all layers of the dense model, mlp_only_layers of the MoE one)
    num_layers: int = 36
    num_attention_heads: int = 32
    num_query_groups: int = 8
    head_dim: int = 128
    norm_epsilon: float = 1e-6
    rope_theta: float = 5000000.0
    mrope_section: tuple[int, ...] = (24, 20, 20)
    mrope_interleaved: bool = True  # frequencies T H W T H W ...; False: megatron's chunked TTT HHH WWW
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    deepstack: bool = True  # add the DeepStack features after the first language layers
    # mixture of experts (num_experts 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 and i is not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True  # transformers renormalises the top-k weights whatever it says; so do we
    moe_aux_loss_coeff: float = 0.0
    moe_token_dispatcher_type: str = "allgather"
    # special tokens
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    # parallelism and precision
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: megatron's default (the TP size)
    # language layers per pipeline stage, e.g. [3, 1]; None: even split
    pipeline_layers: list[int] | None = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1  # the language model's; the vision tower runs on whole images
    params_dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    transformer_impl: str = "local"  # "local" | "transformer_engine"
    extra: dict = field(default_factory=dict)  # further TransformerConfig fields for every tower
    moe_extra: dict = field(default_factory=dict)  # further TransformerConfig fields of the MoE language layers

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layer_pattern(self) -> list[int]:
        """Per language layer: 1 for a MoE layer, 0 for a dense one (transformers' rule)."""
        return [int(self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)
                for i in range(self.num_layers)]

    @property
    def model_type(self) -> str:
        return MODEL_TYPES[self.is_moe]


def validate(c: Qwen3VLConfig) -> Qwen3VLConfig:
    """ValueError (one line) for a shape or layout we cannot build."""
    if len(set(c.deepstack_visual_indexes)) != len(c.deepstack_visual_indexes) or any(
            not 0 <= i < c.vision_depth for i in c.deepstack_visual_indexes):
        raise ValueError(f"deepstack_visual_indexes {list(c.deepstack_visual_indexes)}: each must be a distinct "
                         f"vision layer below the depth {c.vision_depth}")
    if len(c.deepstack_visual_indexes) > c.num_layers:
        raise ValueError(f"{len(c.deepstack_visual_indexes)} DeepStack features for {c.num_layers} language layers")
    if len(c.mrope_section) != 3 or sum(c.mrope_section) != c.head_dim // 2:
        raise ValueError(f"mrope_section {list(c.mrope_section)} must be 3 numbers summing to head_dim / 2 = "
                         f"{c.head_dim // 2}")
    if c.is_moe:
        if not 0 < c.num_experts_per_tok <= c.num_experts or c.moe_intermediate_size <= 0:
            raise ValueError(f"MoE: top-{c.num_experts_per_tok} of {c.num_experts} experts with intermediate size "
                             f"{c.moe_intermediate_size} is not a MoE layer")
        if c.num_experts % c.expert_model_parallel_size:
            raise ValueError(f"{c.num_experts} experts do not divide over expert_model_parallel_size "
                             f"{c.expert_model_parallel_size}")
    elif c.expert_model_parallel_size != 1:
        raise ValueError(f"expert_model_parallel_size {c.expert_model_parallel_size} on a dense model (no experts)")
    deepstack = len(c.deepstack_visual_indexes) if c.deepstack else 0
    first = stage_split(c)[0]
    if first < deepstack:
        raise ValueError(f"the first pipeline stage holds {first} language layers, DeepStack needs the first "
                         f"{deepstack} there (pipeline_layers)")
    return c


def config_from_hf(hf_config: dict, **overrides) -> Qwen3VLConfig:
    """From an HF Qwen3-VL or Qwen3-VL-MoE config (config.json's dict, or a transformers config) as transformers
    4.57 or 5.x saves it (models/hf_config.py)."""
    from mm_adaptor.models import hf_config as hf

    hf_config = hf.config_dict(hf_config)
    model_type = hf.model_type(hf_config)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not Qwen3-VL (one of {', '.join(MODEL_TYPES)})")
    text, vision = hf.text_config(hf_config), hf.vision_config(hf_config)
    rope = hf.rope(hf_config, default_theta=5000000.0)
    if rope.mrope_section is None:
        raise ValueError(f"the HF config has no {rope.spelling}.mrope_section; Qwen3-VL needs it")
    if not rope.interleaved:
        raise ValueError(f"the HF config's {rope.spelling} lacks mrope_interleaved: true; Qwen3-VL's rotary is "
                         "interleaved (transformers applies it so whatever the flag says)")
    if text.get("attention_bias", False):
        raise ValueError("attention_bias: true; Qwen3-VL's language attention has no biases")
    for where, act, known in (("text_config", text.get("hidden_act", "silu"), ("silu",)),
                              ("vision_config", vision.get("hidden_act", "gelu_pytorch_tanh"), ACTIVATIONS)):
        if act not in known:
            raise ValueError(f"{where}.hidden_act {act!r} is not one we build ({', '.join(known)})")
    heads = text["num_attention_heads"]
    moe = model_type == "qwen3_vl_moe"
    experts = (text.get("num_local_experts") or text.get("num_experts") or 0) if moe else 0  # 5.x / 4.x name
    if moe and not experts:
        raise ValueError("a qwen3_vl_moe config without num_experts (4.x) or num_local_experts (5.x)")
    config = Qwen3VLConfig(
        vision_depth=vision["depth"],
        vision_hidden_size=vision["hidden_size"],
        vision_ffn_hidden_size=vision["intermediate_size"],
        vision_num_heads=vision["num_heads"],
        vision_hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
        patch_size=vision.get("patch_size", 16),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        in_channels=vision.get("in_channels", 3),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        num_position_embeddings=vision.get("num_position_embeddings", 2304),
        deepstack_visual_indexes=tuple(vision.get("deepstack_visual_indexes", (8, 16, 24))),
        vision_rope_theta=hf.rope(vision, default_theta=10000.0).theta,
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        ffn_hidden_size=text["intermediate_size"],
        num_layers=text["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        norm_epsilon=text.get("rms_norm_eps", 1e-6),
        rope_theta=rope.theta,
        mrope_section=rope.mrope_section,
        mrope_interleaved=True,
        max_position_embeddings=text.get("max_position_embeddings", 128000),
        tie_word_embeddings=hf.tied(hf_config),  # 5.x: the top-level flag
        num_experts=experts,
        num_experts_per_tok=text.get("num_experts_per_tok", 0) if moe else 0,
        moe_intermediate_size=text.get("moe_intermediate_size", 0) if moe else 0,
        moe_aux_loss_coeff=float(text.get("router_aux_loss_coef", 0.0) or 0.0) if moe else 0.0,
        decoder_sparse_step=text.get("decoder_sparse_step", 1) if moe else 1,
        mlp_only_layers=tuple(text.get("mlp_only_layers") or ()) if moe else (),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        image_token_id=hf_config.get("image_token_id", 151655),
        video_token_id=hf_config.get("video_token_id", 151656),
        vision_start_token_id=hf_config.get("vision_start_token_id", 151652),
    )
    out_hidden = vision.get("out_hidden_size", config.hidden_size)
    if out_hidden != config.hidden_size:
        raise ValueError(f"vision out_hidden_size {out_hidden} != language hidden_size {config.hidden_size}")
    return validate(dataclasses.replace(config, **overrides))


def tiny_config(moe: bool = False, **overrides) -> Qwen3VLConfig:
    """A few-MB model for tests and --model qwen3_vl[_moe]-tiny: 3 vision layers (DeepStack after the first two),
    GQA language model with 4 layers whose head_dim (32) is not hidden / heads (16), untied output layer; MoE: 4
    experts top-2, layer 2 a dense MLP, router aux-loss coefficient 0.001 (transformers' default)."""
    config = Qwen3VLConfig(
        vision_depth=3, vision_hidden_size=64, vision_ffn_hidden_size=96, vision_num_heads=4,
        num_position_embeddings=64, deepstack_visual_indexes=(0, 1), vision_rope_theta=10000.0,
        vocab_size=512, hidden_size=64, ffn_hidden_size=128, num_layers=4, num_attention_heads=4,
        num_query_groups=2, head_dim=32, norm_epsilon=1e-6, rope_theta=10000.0, mrope_section=(6, 5, 5),
        max_position_embeddings=2048, tie_word_embeddings=False,
        image_token_id=500, video_token_id=501, vision_start_token_id=502,
    )
    if moe:
        config = dataclasses.replace(config, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                     decoder_sparse_step=1, mlp_only_layers=(2,),
                                     moe_aux_loss_coeff=0.001)  # transformers' default router_aux_loss_coef
    return validate(dataclasses.replace(config, **overrides))


def tiny_hf_config_dict(config: Qwen3VLConfig | None = None) -> dict:
    """The HF config dict of a Qwen3VLConfig (inverse of config_from_hf) in transformers 4.57's spelling, e.g. to
    build a reference model."""
    c = config or tiny_config()
    text = {
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.ffn_hidden_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_query_groups, "head_dim": c.head_dim, "hidden_act": "silu",
        "rms_norm_eps": c.norm_epsilon, "rope_theta": c.rope_theta, "attention_bias": False,
        "rope_scaling": {"rope_type": "default", "mrope_section": list(c.mrope_section), "mrope_interleaved": True},
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
    }
    if c.is_moe:
        text.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                    moe_intermediate_size=c.moe_intermediate_size, decoder_sparse_step=c.decoder_sparse_step,
                    mlp_only_layers=list(c.mlp_only_layers), norm_topk_prob=c.norm_topk_prob,
                    router_aux_loss_coef=c.moe_aux_loss_coeff)
    return {
        "model_type": c.model_type, "tie_word_embeddings": c.tie_word_embeddings,
        "image_token_id": c.image_token_id, "video_token_id": c.video_token_id,
        "vision_start_token_id": c.vision_start_token_id, "vision_end_token_id": c.vision_start_token_id + 1,
        "text_config": text,
        "vision_config": {
            "depth": c.vision_depth, "hidden_size": c.vision_hidden_size, "intermediate_size": c.vision_ffn_hidden_size,
            "num_heads": c.vision_num_heads, "hidden_act": c.vision_hidden_act, "patch_size": c.patch_size,
            "temporal_patch_size": c.temporal_patch_size, "in_channels": c.in_channels,
            "spatial_merge_size": c.spatial_merge_size, "num_position_embeddings": c.num_position_embeddings,
            "deepstack_visual_indexes": list(c.deepstack_visual_indexes), "out_hidden_size": c.hidden_size,
        },
    }


def vision_transformer_config(c: Qwen3VLConfig):
    """The vision tower's layers: bidirectional, LayerNorm with bias, biased fused qkv/proj, GELU-tanh MLP (not
    gated); no pipeline split, no SP."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=c.vision_depth, hidden_size=c.vision_hidden_size, ffn_hidden_size=c.vision_ffn_hidden_size,
        num_attention_heads=c.vision_num_heads, kv_channels=c.vision_hidden_size // c.vision_num_heads,
        layernorm_epsilon=1e-6, gated_linear_unit=False, activation_func=activation(c.vision_hidden_act),
        add_bias_linear=True, add_qkv_bias=True, pipeline_model_parallel_size=1, sequence_parallel=False,
        **common_fields(c, "LayerNorm"),
    )


def projection_config(c: Qwen3VLConfig):
    """The patch mergers' MLP (the final one and each DeepStack one): merge^2 * vision hidden -> the same -> GELU
    (exact) -> language hidden, with biases."""
    from megatron.core.transformer import TransformerConfig

    merged = c.vision_hidden_size * c.spatial_merge_size**2
    return TransformerConfig(
        num_layers=1, hidden_size=c.hidden_size, ffn_hidden_size=merged, num_attention_heads=c.vision_num_heads,
        layernorm_epsilon=1e-6, gated_linear_unit=False, activation_func=activation("gelu"), add_bias_linear=True,
        pipeline_model_parallel_size=1, sequence_parallel=False, **common_fields(c, "LayerNorm"),
    )


def language_transformer_config(c: Qwen3VLConfig):
    """Qwen3 decoder: GQA without biases, RMSNorm on q and k per head, head_dim from the config, SwiGLU (dense or
    MoE per layer), interleaved mrope (model.py); uneven pipeline splits."""
    from megatron.core.transformer import TransformerConfig

    validate(c)
    kwargs = uneven_stages(c)
    if c.is_moe:
        kwargs.update(
            num_moe_experts=c.num_experts, moe_router_topk=c.num_experts_per_tok,
            moe_ffn_hidden_size=c.moe_intermediate_size,
            # as a list (transformers' rule per layer), megatron keys each language layer of a dist checkpoint
            # apart (the converter's checkpoint_family follows)
            moe_layer_freq=c.moe_layer_pattern,
            expert_model_parallel_size=c.expert_model_parallel_size,
            moe_token_dispatcher_type=c.moe_token_dispatcher_type,
            # top-k of the logits, then softmax over those k: equals transformers' softmax over all experts, top-k,
            # divided by the top-k sum (exp(l_i) / sum_topk exp(l_j) either way)
            moe_router_pre_softmax=False, moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss" if c.moe_aux_loss_coeff else "none",
            moe_aux_loss_coeff=c.moe_aux_loss_coeff, moe_expert_capacity_factor=None, moe_grouped_gemm=False,
        )
        if c.expert_tensor_parallel_size is not None:
            kwargs["expert_tensor_parallel_size"] = c.expert_tensor_parallel_size
        kwargs.update(c.moe_extra)  # the trainer's: Megatron's MoE arguments (dispatcher, grouped GEMM, balancing)
    return TransformerConfig(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups, kv_channels=c.head_dim,
        layernorm_epsilon=c.norm_epsilon, gated_linear_unit=True, activation_func=activation("silu"),
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True, mrope_section=list(c.mrope_section),
        pipeline_model_parallel_size=c.pipeline_model_parallel_size, sequence_parallel=c.sequence_parallel,
        context_parallel_size=c.context_parallel_size, **kwargs, **common_fields(c, "RMSNorm"),
    )
