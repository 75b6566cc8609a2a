"""InternVL's shape as one dataclass, read from either checkpoint layout's config.json, and megatron
TransformerConfigs for its towers.

- the transformers-native layout (`model_type` "internvl", `-hf` checkpoints): `vision_config` (InternVLVisionConfig:
  norm_type, use_qk_norm, attention_bias, layer_scale, image_size/patch_size as pairs), `text_config`;
- the original OpenGVLab layout (`model_type` "internvl_chat", remote code): `vision_config` (InternViT:
  qkv_bias, qk_normalization, norm_type), `llm_config`, `select_layer`, `ps_version`, `force_image_size`. Its
  image token is the tokenizer's <IMG_CONTEXT>: not in the config, so it is read from `image_token_id` where a
  converted checkpoint wrote one, else Qwen2's 151667 (the id transformers' own conversion gives it).

InternViT comes in two variants, both read from the config: the 300M class (LayerNorm, no QK-norm, qkv bias) and
the 6B class (RMSNorm, RMSNorm over all heads on q and k, no qkv bias)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mm_adaptor.models.megatron_config import activation, common_fields, uneven_stages

NATIVE, ORIGINAL = "internvl", "internvl_chat"
LANGUAGE_MODELS = ("qwen2", "qwen3")
NORMS = {"layer_norm": "LayerNorm", "rms_norm": "RMSNorm"}
QWEN2_IMAGE_CONTEXT = 151667
QK_NORM_EPS = 1e-6  # transformers' InternVLVisionRMSNorm default, which q_norm and k_norm keep


@dataclass
class InternVLConfig:
    # vision tower (InternViT)
    vision_depth: int = 24
    vision_hidden_size: int = 1024
    vision_ffn_hidden_size: int = 4096
    vision_num_heads: int = 16
    vision_hidden_act: str = "gelu"
    vision_norm: str = "layer_norm"  # "layer_norm" (300M class) | "rms_norm" (6B class)
    vision_norm_epsilon: float = 1e-6
    vision_qkv_bias: bool = True
    vision_qk_norm: bool = False
    image_size: int = 448  # the tile side the position embeddings were trained for
    patch_size: int = 14
    in_channels: int = 3
    vision_feature_layer: int = -1
    # projector
    downsample_ratio: float = 0.5
    projector_hidden_act: str = "gelu"
    # language model
    language_model_type: str = "qwen2"  # "qwen2" (qkv bias) | "qwen3" (q/k RMSNorm per head, no bias)
    vocab_size: int = 151674
    hidden_size: int = 896
    ffn_hidden_size: int = 4864
    num_layers: int = 24
    num_attention_heads: int = 14
    num_query_groups: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    norm_epsilon: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 32768
    # rope_scaling "dynamic" (InternVL3's llm_config, factor 2): plain RoPE up to max_position_embeddings, where
    # transformers rescales nothing; the model refuses positions beyond it
    rope_dynamic_factor: float | None = None
    tie_word_embeddings: bool = False
    # special tokens
    image_token_id: int = QWEN2_IMAGE_CONTEXT
    image_seq_length: int = 256
    # parallelism and precision
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    pipeline_layers: list[int] | None = None  # language layers per pipeline stage; None: even split
    sequence_parallel: bool = False
    context_parallel_size: int = 1  # the language model's; the vision tower runs on whole tiles
    params_dtype: str = "float32"
    transformer_impl: str = "local"
    extra: dict = field(default_factory=dict)

    @property
    def image_start_token_id(self) -> int:
        """<img>: InternVL's vocabularies hold <img>, </img>, <IMG_CONTEXT> as three consecutive ids (Qwen2's
        151665 .. 151667)."""
        return self.image_token_id - 2

    @property
    def image_end_token_id(self) -> int:
        return self.image_token_id - 1

    # the names the data tools give the vision ids (data.tokenizer.model_token_ids): <img> opens an image as
    # <|vision_start|> does (and </img> = <img> + 1 closes it); InternVL has no video pad, the id after
    # <IMG_CONTEXT> stands in for it
    @property
    def vision_start_token_id(self) -> int:
        return self.image_start_token_id

    @property
    def video_token_id(self) -> int:
        return self.image_token_id + 1

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def shuffle(self) -> int:
        """Neighbours a side merged by the pixel shuffle (2 for downsample_ratio 0.5)."""
        return round(1 / self.downsample_ratio)

    @property
    def merged_size(self) -> int:
        return self.vision_hidden_size * self.shuffle**2

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    def tokens_per_tile(self, tile_size: int | None = None) -> int:
        return ((tile_size or self.image_size) // self.patch_size // self.shuffle) ** 2

    @property
    def vision_layers_run(self) -> int:
        """The vision layers whose output the projector takes (vision_feature_layer: -1 the last, -k the k-th
        from the end)."""
        return self.vision_depth + 1 + self.vision_feature_layer


def validate(c: InternVLConfig) -> InternVLConfig:
    if c.language_model_type not in LANGUAGE_MODELS:
        raise ValueError(f"InternVL: language model {c.language_model_type!r} is not built "
                         f"(built: {', '.join(LANGUAGE_MODELS)})")
    if c.vision_norm not in NORMS:
        raise ValueError(f"InternVL: vision norm_type {c.vision_norm!r} is not one of {', '.join(NORMS)}")
    if abs(1 / c.downsample_ratio - c.shuffle) > 1e-9 or c.shuffle < 1:
        raise ValueError(f"InternVL: downsample_ratio {c.downsample_ratio} must be 1 / an integer")
    if c.image_size % c.patch_size or c.patches_per_side % c.shuffle:
        raise ValueError(f"InternVL: image_size {c.image_size} must be a multiple of patch_size {c.patch_size} "
                         f"times {c.shuffle}")
    if not -c.vision_depth <= c.vision_feature_layer <= -1:
        raise ValueError(f"InternVL: vision_feature_layer {c.vision_feature_layer} must be -1 .. -{c.vision_depth}")
    if c.vision_hidden_act not in ("gelu",) or c.projector_hidden_act not in ("gelu",):
        raise ValueError(f"InternVL: activations {c.vision_hidden_act!r} / {c.projector_hidden_act!r} are not built "
                         "(gelu)")
    return c


def _pair(value, name: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"InternVL: non-square {name} {list(value)} is not supported")
        value = value[0]
    return int(value)


def layout_of(hf_config: dict) -> str:
    model_type = hf_config.get("model_type")
    if model_type not in (NATIVE, ORIGINAL):
        raise ValueError(f"model_type {model_type!r} is not InternVL (expected {NATIVE!r}, the transformers-native "
                         f"layout, or {ORIGINAL!r}, the OpenGVLab one)")
    return model_type


def config_from_hf(hf_config: dict, **overrides) -> InternVLConfig:
    """From an InternVL config.json of either layout (see the module's docstring), as transformers 4.57 or 5.x
    saves it."""
    from mm_adaptor.models import hf_config as hf

    layout = layout_of(hf_config)
    vision = dict(hf_config.get("vision_config") or {})
    if layout == NATIVE:
        text = hf.text_config(hf_config)
        if vision.get("use_mean_pooling", True) is False:
            raise ValueError("InternVL: use_mean_pooling=false (a final vision LayerNorm) is not built")
        if vision.get("use_absolute_position_embeddings", True) is False:
            raise ValueError("InternVL: use_absolute_position_embeddings=false is not built")
        if hf_config.get("vision_feature_select_strategy", "default") != "default":
            raise ValueError("InternVL: vision_feature_select_strategy must be 'default' (the class token dropped)")
        qkv_bias, qk_norm = vision.get("attention_bias", False), vision.get("use_qk_norm", False)
        feature_layer = hf_config.get("vision_feature_layer", -1)
        image_token = hf_config.get("image_token_id", QWEN2_IMAGE_CONTEXT)
        seq_length = hf_config.get("image_seq_length", 256)
        projector_act = hf_config.get("projector_hidden_act", "gelu")
        tie = hf.tied(hf_config)
    else:
        text = dict(hf_config.get("llm_config") or {})
        if not text:
            raise ValueError("InternVL (OpenGVLab layout): the config has no llm_config")
        if hf_config.get("ps_version", "v2") != "v2":
            raise ValueError(f"InternVL: ps_version {hf_config.get('ps_version')!r} (the v1 pixel shuffle) is not "
                             "built; v2 is")
        qkv_bias, qk_norm = vision.get("qkv_bias", True), vision.get("qk_normalization", False)
        feature_layer = hf_config.get("select_layer", -1)
        image_token = hf_config.get("image_token_id", QWEN2_IMAGE_CONTEXT)
        seq_length = None
        projector_act = "gelu"
        tie = bool(text.get("tie_word_embeddings", hf_config.get("tie_word_embeddings", False)))
    language_type = text.get("model_type", "qwen2")
    rope = hf.rope({"text_config": text}, default_theta=1000000.0)
    dynamic = None
    for spelling in ("rope_scaling", "rope_parameters"):
        kind = (text.get(spelling) or {}).get("rope_type", (text.get(spelling) or {}).get("type", "default"))
        if kind == "dynamic":
            dynamic = float(text[spelling]["factor"])
        elif kind != "default":
            raise ValueError(f"InternVL: {spelling} type {kind!r} is not built (plain RoPE is, and 'dynamic' up "
                             "to max_position_embeddings)")
    if text.get("use_sliding_window"):
        raise ValueError("InternVL: the language model's sliding-window attention is not built")
    heads = text["num_attention_heads"]
    image_size = _pair(hf_config.get("force_image_size") or vision.get("image_size", 448), "image_size")
    patch = _pair(vision.get("patch_size", 14), "patch_size")
    config = InternVLConfig(
        vision_depth=vision["num_hidden_layers"], vision_hidden_size=vision["hidden_size"],
        vision_ffn_hidden_size=vision["intermediate_size"], vision_num_heads=vision["num_attention_heads"],
        vision_hidden_act=vision.get("hidden_act", "gelu"), vision_norm=vision.get("norm_type", "layer_norm"),
        vision_norm_epsilon=vision.get("layer_norm_eps", 1e-6), vision_qkv_bias=bool(qkv_bias),
        vision_qk_norm=bool(qk_norm), image_size=image_size, patch_size=patch,
        in_channels=vision.get("num_channels", 3), vision_feature_layer=feature_layer,
        downsample_ratio=hf_config.get("downsample_ratio", 0.5), projector_hidden_act=projector_act,
        language_model_type=language_type, vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        ffn_hidden_size=text["intermediate_size"], num_layers=text["num_hidden_layers"], num_attention_heads=heads,
        num_query_groups=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") if language_type == "qwen3" else None,
        norm_epsilon=text.get("rms_norm_eps", 1e-6), rope_theta=rope.theta,
        max_position_embeddings=text.get("max_position_embeddings", 32768), rope_dynamic_factor=dynamic,
        tie_word_embeddings=tie,
        image_token_id=image_token, image_seq_length=0,
    )
    validate(config)
    config.image_seq_length = seq_length or config.tokens_per_tile()
    if config.image_seq_length != config.tokens_per_tile():
        raise ValueError(f"InternVL: image_seq_length {config.image_seq_length} != the "
                         f"{config.tokens_per_tile()} tokens a {image_size} px tile gives")
    if language_type == "qwen2" and text.get("head_dim") not in (None, config.kv_channels):
        raise ValueError(f"InternVL: Qwen2 head_dim {text['head_dim']} != hidden_size / heads")
    return validate(dataclasses.replace(config, **overrides))


def tiny_config(variant: str = "300m", **overrides) -> InternVLConfig:
    """A few-MB model for tests and --model internvl-tiny: InternViT with 2 layers (variant "300m": LayerNorm, qkv
    bias; "6b": RMSNorm, QK-norm, no qkv bias) on 28 px tiles of 4 x 4 patches (4 tokens a tile), a Qwen2 language
    model with GQA, 2 layers, untied output."""
    six_b = variant == "6b"
    config = InternVLConfig(
        vision_depth=2, vision_hidden_size=32, vision_ffn_hidden_size=64, vision_num_heads=4,
        vision_norm="rms_norm" if six_b else "layer_norm", vision_qkv_bias=not six_b, vision_qk_norm=six_b,
        image_size=28, patch_size=7, vocab_size=512, hidden_size=64, ffn_hidden_size=128, num_layers=4,
        num_attention_heads=4, num_query_groups=2, rope_theta=10000.0, max_position_embeddings=2048,
        image_token_id=500, image_seq_length=4,
    )
    return validate(dataclasses.replace(config, **overrides))


def tiny_hf_config_dict(config: InternVLConfig | None = None) -> dict:
    """The native (transformers) config dict of an InternVLConfig (inverse of config_from_hf)."""
    c = config or tiny_config()
    text = {
        "model_type": c.language_model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.ffn_hidden_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_query_groups,
        "rms_norm_eps": c.norm_epsilon, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
    }
    if c.language_model_type == "qwen3":
        text["head_dim"] = c.kv_channels
    if c.rope_dynamic_factor is not None:
        text["rope_scaling"] = {"rope_type": "dynamic", "type": "dynamic", "factor": c.rope_dynamic_factor}
    return {
        "model_type": NATIVE, "image_token_id": c.image_token_id, "image_seq_length": c.image_seq_length,
        "downsample_ratio": c.downsample_ratio, "projector_hidden_act": c.projector_hidden_act,
        "vision_feature_layer": c.vision_feature_layer, "vision_feature_select_strategy": "default",
        "tie_word_embeddings": c.tie_word_embeddings, "text_config": text,
        "vision_config": {
            "hidden_size": c.vision_hidden_size, "num_hidden_layers": c.vision_depth,
            "num_attention_heads": c.vision_num_heads, "intermediate_size": c.vision_ffn_hidden_size,
            "hidden_act": c.vision_hidden_act, "norm_type": c.vision_norm, "layer_norm_eps": c.vision_norm_epsilon,
            "attention_bias": c.vision_qkv_bias, "use_qk_norm": c.vision_qk_norm,
            "image_size": [c.image_size, c.image_size], "patch_size": [c.patch_size, c.patch_size],
            "num_channels": c.in_channels, "use_absolute_position_embeddings": True, "use_mean_pooling": True,
        },
    }


def original_config_dict(config: InternVLConfig) -> dict:
    """The OpenGVLab layout's config dict (model_type internvl_chat) of an InternVLConfig."""
    native = tiny_hf_config_dict(config)
    vision = {k: v for k, v in native["vision_config"].items()
              if k not in ("attention_bias", "use_qk_norm", "use_absolute_position_embeddings", "use_mean_pooling")}
    vision.update(model_type="intern_vit_6b", qkv_bias=config.vision_qkv_bias, qk_normalization=config.vision_qk_norm,
                  image_size=config.image_size, patch_size=config.patch_size)
    return {
        "model_type": ORIGINAL, "architectures": ["InternVLChatModel"], "vision_config": vision,
        "llm_config": native["text_config"], "downsample_ratio": config.downsample_ratio,
        "select_layer": config.vision_feature_layer, "ps_version": "v2", "force_image_size": config.image_size,
        "image_token_id": config.image_token_id, "tie_word_embeddings": config.tie_word_embeddings,
    }


def vision_transformer_config(c: InternVLConfig):
    """InternViT's layers: bidirectional, biased proj and MLP (qkv bias per variant), GELU, LayerNorm or RMSNorm,
    the 6B class's QK-norm (vision.AllHeadsRMSNorm); no pipeline split, no SP."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=c.vision_depth, hidden_size=c.vision_hidden_size, ffn_hidden_size=c.vision_ffn_hidden_size,
        num_attention_heads=c.vision_num_heads, kv_channels=c.vision_hidden_size // c.vision_num_heads,
        layernorm_epsilon=c.vision_norm_epsilon, gated_linear_unit=False,
        activation_func=activation(c.vision_hidden_act), add_bias_linear=True, add_qkv_bias=c.vision_qkv_bias,
        qk_layernorm=c.vision_qk_norm, pipeline_model_parallel_size=1, sequence_parallel=False,
        **common_fields(c, NORMS[c.vision_norm]),
    )


def projection_config(c: InternVLConfig):
    """The projector's MLP after the pixel shuffle: merged vision width -> language hidden -> GELU -> language
    hidden; its LayerNorm (eps 1e-5, torch's default) normalises the merged width."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=c.hidden_size, ffn_hidden_size=c.hidden_size,
        num_attention_heads=c.vision_num_heads, layernorm_epsilon=1e-5, gated_linear_unit=False,
        activation_func=activation(c.projector_hidden_act), add_bias_linear=True, pipeline_model_parallel_size=1,
        sequence_parallel=False, **common_fields(c, "LayerNorm"),
    )


def language_transformer_config(c: InternVLConfig):
    """Qwen2 (GQA, qkv bias) or Qwen3 (GQA, q/k RMSNorm per head, head_dim), SwiGLU, RMSNorm, 1-D rope; uneven
    pipeline splits."""
    from megatron.core.transformer import TransformerConfig

    validate(c)
    kwargs = uneven_stages(c)
    qwen3 = c.language_model_type == "qwen3"
    return TransformerConfig(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups, kv_channels=c.kv_channels,
        layernorm_epsilon=c.norm_epsilon, gated_linear_unit=True, activation_func=activation("silu"),
        add_bias_linear=False, add_qkv_bias=not qwen3, qk_layernorm=qwen3,
        pipeline_model_parallel_size=c.pipeline_model_parallel_size, sequence_parallel=c.sequence_parallel,
        context_parallel_size=c.context_parallel_size, **kwargs, **common_fields(c, "RMSNorm"),
    )
