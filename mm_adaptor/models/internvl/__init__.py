"""InternVL (InternViT + pixel-shuffle projector + Qwen2/Qwen3) built from megatron-core modules, read from
checkpoints of either layout (transformers-native, OpenGVLab)."""

from mm_adaptor.models.internvl.config import (  # noqa: F401
    InternVLConfig, config_from_hf, language_transformer_config, original_config_dict, projection_config,
    tiny_config, tiny_hf_config_dict, vision_transformer_config,
)

# what InternVL's tokenizers call the tokens the data tools name as Qwen's (data.tokenizer.token_names); no video pad
TOKEN_NAMES = {"<|vision_start|>": "<img>", "<|vision_end|>": "</img>", "<|image_pad|>": "<IMG_CONTEXT>",
               "<|video_pad|>": None}


def model_provider(*args, **kwargs):
    """See model.model_provider (imported on call: megatron loads only when a model is built)."""
    from mm_adaptor.models.internvl.model import model_provider as provide

    return provide(*args, **kwargs)


def rope_index_for(config, input_ids, *args, **kwargs):
    """(positions [b, s], None): InternVL's language model has plain 1-D rope, whatever the images."""
    import torch

    return torch.arange(input_ids.shape[-1], device=input_ids.device).expand(input_ids.shape[0], -1), None


def synthetic_visual(config, generator):
    """The driver's synthetic sample's image (NAME-tiny without --data-path): (prompt ids <img>, the tile's
    <IMG_CONTEXT> pads, </img>; pixel_values [1, 3, S, S] of one random tile)."""
    import torch

    pixels = torch.randn(1, config.in_channels, config.image_size, config.image_size, generator=generator)
    prompt = [config.image_start_token_id] + [config.image_token_id] * config.image_seq_length + \
        [config.image_end_token_id]
    return prompt, pixels


def vision_forward_flops(config, batch) -> tuple[float, float]:
    """(tower, projector) forward FLOPs of the batch's tiles (mm_adaptor.models.vision_flops)."""
    from mm_adaptor.models import vision_flops

    pixels = batch.get("pixel_values")
    return vision_flops.internvl(config, 0 if pixels is None else int(pixels.shape[0]))
