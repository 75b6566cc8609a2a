"""Vision-language models built from megatron-core modules, one package per family."""

import importlib


def family_package(config):
    """The model package a family's config dataclass belongs to (mm_adaptor.models.<family>)."""
    return importlib.import_module(type(config).__module__.rsplit(".", 1)[0])


def rope_index_for(config, *args, **kwargs):
    """The 3-D rope index of the config's family (its package's rope_index_for)."""
    return family_package(config).rope_index_for(config, *args, **kwargs)


def sample_positions(config, tokens, image_grid_thw=None, **videos):
    """One sample's positions from 0 as the packer takes them: [3, L] (3-D rope) or [L], for tokens [L]; `videos`:
    video_grid_thw (and Qwen2.5-VL's second_per_grid_ts) where the sample has videos."""
    import torch

    mask = torch.ones(1, tokens.numel(), dtype=torch.long)
    videos = {name: value for name, value in videos.items() if value is not None}
    positions, _ = rope_index_for(config, tokens.unsqueeze(0), image_grid_thw=image_grid_thw, attention_mask=mask,
                                  **videos)
    return positions[..., 0, :] if positions.dim() == 3 else positions[0]
