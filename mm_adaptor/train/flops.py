"""The trainer's FLOP count: Megatron's own for the language model (num_floating_point_operations, over the rows
the step trained: its samples, or its packs with --packing) plus a vision-language family's vision side
(mm_adaptor.models.vision_flops, from the images each step read)."""

from __future__ import annotations

_CONFIG: dict = {}


def _family_config(args):
    from mm_adaptor.train import families

    family = families.of(args)
    if not hasattr(family, "model_config"):
        return None, None
    key = id(args)
    if key not in _CONFIG:
        _CONFIG.clear()
        _CONFIG[key] = family.model_config(args)
    return family, _CONFIG[key]


def vision_flops_of_batch(batch: dict) -> float:
    """Training FLOPs of this micro-batch's vision side (0 for a text-only family)."""
    from megatron.training import get_args

    from mm_adaptor.models import family_package, vision_flops

    args = get_args()
    family, config = _family_config(args)
    if config is None or (batch.get("pixel_values") is None and batch.get("pixel_values_videos") is None):
        return 0.0
    tower, projector = family_package(config).vision_forward_flops(config, batch)
    return vision_flops.training_flops(tower, projector, tower_trained=not args.freeze_vision,
                                       projector_trained=not getattr(args, "freeze_projector", False))
