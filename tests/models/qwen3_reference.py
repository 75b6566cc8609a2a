"""Test helpers for Qwen3-VL: the transformers reference model (dense or MoE), images, a video as frames, prompts,
transformers' own 3-D positions, and HF weights cut into one rank's shards (TP, expert TP, EP, PP) through the
family's mapping (mm_adaptor.models.qwen3_vl.mapping)."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from mm_adaptor.models.qwen3_vl import Qwen3VLConfig, tiny_hf_config_dict

TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
# (height, width): multiples of patch * merge (32), non-square, so that the processor does not resize them
IMAGE_SIZES = [(96, 160), (128, 64)]
VIDEO_FRAMES, VIDEO_SIZE = 4, (64, 96)  # 4 frames -> 2 temporal patches


def hf_model(config: Qwen3VLConfig, seed: int = 0):
    """transformers' Qwen3VL(Moe)ForConditionalGeneration of the config, eager attention, every weight random."""
    torch.manual_seed(seed)
    if config.is_moe:
        hf_config = transformers.Qwen3VLMoeConfig(**tiny_hf_config_dict(config))
        cls = transformers.Qwen3VLMoeForConditionalGeneration
    else:
        hf_config = transformers.Qwen3VLConfig(**tiny_hf_config_dict(config))
        cls = transformers.Qwen3VLForConditionalGeneration
    hf_config._attn_implementation = "eager"
    model = cls(hf_config).eval()
    with torch.no_grad():  # HF zero-initialises biases and ones norms (and 5.x its router): make every weight count
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("mlp.gate.weight") and not param.abs().max() > 0:
                param.normal_(0, 0.02)
    return model


def preprocessing():
    """The repository's Qwen3-VL preprocessing (mm_adaptor.data.images: patch 16, merge 2, mean = std = 0.5) with
    pixel bounds that keep the test pictures at their size."""
    from mm_adaptor.data.images import QWEN3_VL

    return QWEN3_VL.with_pixels(min_pixels=32 * 32, max_pixels=64 * 32 * 32)


def transformers_processor():
    """transformers' image processor with the same values (to check the repository's against)."""
    from hf_compat import slow_qwen2_vl_image_processor

    Qwen2VLImageProcessor = slow_qwen2_vl_image_processor()

    processing = preprocessing()
    return Qwen2VLImageProcessor(patch_size=processing.patch_size, merge_size=processing.merge_size,
                                 temporal_patch_size=processing.temporal_patch_size,
                                 image_mean=list(processing.image_mean), image_std=list(processing.image_std),
                                 min_pixels=processing.min_pixels, max_pixels=processing.max_pixels)


def pictures(sizes=IMAGE_SIZES, seed: int = 1):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def images(sizes=IMAGE_SIZES, seed: int = 1):
    """(pixel_values [patches, 3 * 2 * 16 * 16], image_grid_thw [n, 3])."""
    out = [preprocessing().preprocess(picture) for picture in pictures(sizes, seed)]
    return (torch.from_numpy(np.concatenate([pixels for pixels, _ in out])),
            torch.tensor([list(grid) for _, grid in out]))


def video(frames: int = VIDEO_FRAMES, size=VIDEO_SIZE, seed: int = 4):
    """A short random video given as frames -> (pixel_values_videos, video_grid_thw [1, 3]) by the repository's
    emulation of transformers 4.57's Qwen3VLVideoProcessor (which needs torchvision): frames in temporal pairs,
    patches in merge blocks, as the image processor flattens them."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    clip = [Image.fromarray(f) for f in rng.integers(0, 256, (frames, *size, 3), dtype=np.uint8)]
    pixels, grid = preprocessing().video_frames(clip)
    return torch.from_numpy(pixels), torch.tensor([list(grid)])


def prompt(config: Qwen3VLConfig, image_grid=None, video_grid=None, text_lengths=(5, 4, 3), seed: int = 2):
    """[1, s]: text; per image vision-start, pads, vision-end and text; then per video frame group a timestamp
    (two text tokens), vision-start, pads, vision-end (as the Qwen3-VL processor lays out a video), and text;
    s even (sequence parallel)."""
    gen = torch.Generator().manual_seed(seed)

    def words(n):
        return torch.randint(0, config.image_token_id - 10, (n,), generator=gen)

    start, end = torch.tensor([config.vision_start_token_id]), torch.tensor([config.vision_start_token_id + 1])
    merge = config.spatial_merge_size**2
    pieces = [words(text_lengths[0])]
    for i, (t, h, w) in enumerate([] if image_grid is None else image_grid.tolist()):
        pieces += [start, torch.full((t * h * w // merge,), config.image_token_id), end,
                   words(text_lengths[1 + i % 2])]
    for t, h, w in [] if video_grid is None else video_grid.tolist():
        for _ in range(t):
            pieces += [words(2), start, torch.full((h * w // merge,), config.video_token_id), end]
        pieces.append(words(text_lengths[-1]))
    ids = torch.cat(pieces)
    if len(ids) % 2:
        ids = torch.cat([ids, ids[:1]])
    return ids.unsqueeze(0)


def token_types(config: Qwen3VLConfig, ids: torch.Tensor) -> torch.Tensor:
    """transformers 5.x's mm_token_type_ids: 0 text, 1 image pad, 2 video pad."""
    return (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()


def hf_positions(model, config: Qwen3VLConfig, ids, image_grid=None, video_grid=None) -> torch.Tensor:
    """[3, b, s] from transformers' own get_rope_index (4.57 or 5.x signature)."""
    video_grid = None if video_grid is None else video_grid.clone()  # 4.57 writes into it
    if TRANSFORMERS_5:
        return model.model.get_rope_index(ids, token_types(config, ids), image_grid, video_grid)[0]
    return model.model.get_rope_index(ids, image_grid, video_grid)[0]


def hf_logits(model, config: Qwen3VLConfig, ids, pixels=None, image_grid=None, video_pixels=None, video_grid=None):
    kwargs = {"mm_token_type_ids": token_types(config, ids)} if TRANSFORMERS_5 else {}
    return model(input_ids=ids, pixel_values=pixels, image_grid_thw=image_grid, pixel_values_videos=video_pixels,
                 video_grid_thw=video_grid, **kwargs).logits


def megatron_tensors(hf_state: dict, config: Qwen3VLConfig, saved_by: str | None = None) -> dict:
    """Whole Megatron tensors (global names) through the family's rules, from an HF state dict with its experts
    fused (as the transformers `saved_by` holds them; default: the installed one) or one tensor set per expert."""
    from mm_adaptor.convert import hf_to_mcore_tensors
    from mm_adaptor.models.qwen3_vl import mapping

    hf_config = tiny_hf_config_dict(config)
    if saved_by:
        hf_config["transformers_version"] = saved_by
    return hf_to_mcore_tensors(mapping.family(hf_config), hf_state)


def _gated(name: str) -> bool:
    """SwiGLU's fc1 holds [gate; up]: a TP shard takes its rows of each half."""
    return name.startswith("language_model.") and name.endswith("linear_fc1.weight")


def local_shard(model, whole: dict) -> dict:
    """This rank's state dict (TP, expert TP, EP, PP as megatron's parallel state says) from whole tensors."""
    from megatron.core import parallel_state as ps

    layers = model.language_model.decoder.layers
    experts_here = model.model_config.num_experts // max(ps.get_expert_model_parallel_world_size(), 1)
    expert_offset = ps.get_expert_model_parallel_rank() * experts_here
    out = {}
    for name, param in model.named_parameters():
        source = name
        match = name.startswith("language_model.decoder.layers.")
        if match:
            local = int(name.split(".")[3])
            source = source.replace(f"layers.{local}.", f"layers.{layers[local].layer_number - 1}.", 1)
        if ".local_experts." in source:
            head, tail = source.split(".local_experts.")
            e, rest = tail.split(".", 1)
            source = f"{head}.local_experts.{int(e) + expert_offset}.{rest}"
        tensor = whole[source]
        if getattr(param, "tensor_model_parallel", False):
            expert = ".local_experts." in name
            size = ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size()
            rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
            dim = param.partition_dim
            if _gated(name):
                tensor = torch.cat([half.chunk(size, dim)[rank] for half in tensor.chunk(2, 0)])
            else:
                tensor = tensor.chunk(size, dim)[rank]
        out[name] = tensor
    return out


def load_hf_weights(model, hf_state: dict, config: Qwen3VLConfig) -> None:
    """Loads an HF state dict (either expert form) into this rank's model; every parameter must be covered."""
    shard = local_shard(model, megatron_tensors(hf_state, config))
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert set(own) == set(shard), f"missing {set(own) - set(shard)}, unexpected {set(shard) - set(own)}"
    for key, value in shard.items():
        assert own[key].shape == value.shape, f"{key}: {tuple(own[key].shape)} vs {tuple(value.shape)}"
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in shard.items()}, strict=False)
