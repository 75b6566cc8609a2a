"""Qwen3-VL and Qwen3-VL-MoE built from megatron-core modules (needs the vlm extra only for the converter and the
reference tests)."""

from mm_adaptor.models.qwen3_vl.config import (  # noqa: F401
    Qwen3VLConfig, config_from_hf, language_transformer_config, projection_config, tiny_config, tiny_hf_config_dict,
    vision_transformer_config,
)

# Qwen3-VL's chat template writes a system turn only for a system message (Qwen2.5-VL's adds a default one)
DEFAULT_SYSTEM_PROMPT = None


def model_provider(*args, **kwargs):
    """See model.model_provider (imported on call: megatron loads only when a model is built)."""
    from mm_adaptor.models.qwen3_vl.model import model_provider as provide

    return provide(*args, **kwargs)


def rope_index_for(*args, **kwargs):
    """See positions.rope_index_for (the 3-D interleaved rope index; imported on call)."""
    from mm_adaptor.models.qwen3_vl.positions import rope_index_for as index

    return index(*args, **kwargs)


def rope_index(*args, **kwargs):
    """See positions.rope_index (imported on call)."""
    from mm_adaptor.models.qwen3_vl.positions import rope_index as index

    return index(*args, **kwargs)


def vision_forward_flops(config, batch) -> tuple[float, float]:
    """(tower, projector) forward FLOPs of the batch's images and videos (mm_adaptor.models.vision_flops)."""
    from mm_adaptor.models import vision_flops

    grids = [grid for key in ("image_grid_thw", "video_grid_thw") if batch.get(key) is not None
             for grid in batch[key].tolist()]
    return vision_flops.qwen3_vl(config, grids)
