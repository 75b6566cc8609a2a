"""Qwen-VL image and video preprocessing with PIL and numpy (torch resizes video frames); transformers' processors
define the result.

An image becomes pixel_values [grid_t*grid_h*grid_w, 3*T*P*P] (float32) and grid_thw (grid_t, grid_h, grid_w), for
patch P, temporal patch T and merge size M: resized to multiples of P*M by `smart_resize`, RGB, bicubic, scaled to
[0, 1], normalised with the family's mean/std, the one frame repeated to the temporal patch, patches in
transformers' flatten order. The module-level functions keep Qwen2.5-VL's parameters (P=14, T=2, M=2, CLIP's
statistics: 3*2*14*14 = 1176 values a patch); `ImageProcessing` carries any family's, read from the checkpoint's
preprocessor_config.json (Qwen3-VL: P=16, mean = std = 0.5, 1536 values a patch).

Why the file and not transformers' defaults: transformers maps Qwen3-VL to the Qwen2-VL image processor class, whose
defaults are Qwen2's (patch 14, CLIP statistics); and 4.57's slow Qwen2VLImageProcessor drops a `size` given to
its constructor (the spelling Qwen3-VL's file uses) for its 56*56 .. 28*28*1280 defaults. Only the file says what
the model was trained with."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from mm_adaptor.data.pixels import refuse_unsupported as _refuse_unsupported, to_rgb  # noqa: F401

IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
PREPROCESSOR_CONFIG = "preprocessor_config.json"
VIDEO_PREPROCESSOR_CONFIG = "video_preprocessor_config.json"


@dataclasses.dataclass(frozen=True)
class ImageProcessing:
    """A family's preprocessing parameters (Qwen2.5-VL's by default) and the operations that use them."""
    patch_size: int = PATCH_SIZE
    merge_size: int = MERGE_SIZE
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE
    image_mean: tuple = IMAGE_MEAN
    image_std: tuple = IMAGE_STD
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_preprocessor_config(cls, config: dict, defaults: ImageProcessing | None = None) -> ImageProcessing:
        """From a preprocessor_config.json's dict (or video_preprocessor_config.json's). The pixel bounds are
        min_pixels/max_pixels, or size {"shortest_edge", "longest_edge"} as newer transformers writes them (the
        former wins, as in transformers). A field the file lacks comes from `defaults`; without defaults it is an
        error naming it."""
        _refuse_unsupported(config)
        size = config.get("size") or {}
        found = {f.name: config[f.name] for f in dataclasses.fields(cls) if config.get(f.name) is not None}
        for ours, theirs in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if ours not in found and size.get(theirs) is not None:
                found[ours] = size[theirs]
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in found]
        if missing and defaults is None:
            raise ValueError(f"the preprocessor config lacks {', '.join(missing)} (min_pixels/max_pixels may be "
                             f"given as size shortest_edge/longest_edge)")
        values = {name: getattr(defaults, name) for name in missing}
        values.update(found)
        for name in ("image_mean", "image_std"):
            values[name] = tuple(float(v) for v in values[name])
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            values[name] = int(values[name])
        return cls(**values)

    @classmethod
    def for_model(cls, config) -> ImageProcessing:
        """The family's defaults for a model config (ours, transformers', an HF config dict: anything with
        model_type or of a family package), its patch, merge and temporal sizes where the config names them.
        For a real checkpoint use for_directory: only its preprocessor_config.json is authoritative."""
        family = model_family(config)
        if family in TILED_FAMILIES:
            return _tiling(config)
        if family not in FAMILY_DEFAULTS:
            raise ValueError(f"no image preprocessing known for model family {family!r} "
                             f"(known: {', '.join(FAMILY_DEFAULTS)})")
        return dataclasses.replace(FAMILY_DEFAULTS[family], **_model_sizes(config))

    @classmethod
    def for_directory(cls, directory, config, video: bool = False) -> ImageProcessing:
        """A converted checkpoint's preprocessing: DIR/preprocessor_config.json (video: video_preprocessor_config.json)
        for Qwen3-VL, required, its patch, merge and temporal sizes checked against the model config's. Qwen2.5-VL
        keeps this repository's defaults (for_model) without reading the file, as its training and generation
        always did (its published file says max_pixels 12845056, the default here is 28*28*1280)."""
        family = model_family(config)
        if family in TILED_FAMILIES:
            return _tiling(config, directory)
        if family == "qwen2_5_vl" or family not in FAMILY_DEFAULTS:
            return cls.for_model(config)  # (for_model names an unknown family)
        path = Path(directory) / (VIDEO_PREPROCESSOR_CONFIG if video else PREPROCESSOR_CONFIG)
        if not path.is_file():
            raise ValueError(f"{path} is missing: a {family} checkpoint's preprocessing (patch size, mean/std, pixel "
                             f"bounds) must come from it; copy it from the Hugging Face model directory")
        processing = cls.from_preprocessor_config(json.loads(path.read_text()))
        wrong = {k: (getattr(processing, k), v) for k, v in _model_sizes(config).items() if getattr(processing, k) != v}
        if wrong:
            said = ", ".join(f"{k} {ours} (model: {theirs})" for k, (ours, theirs) in wrong.items())
            raise ValueError(f"{path} does not fit the model: {said}")
        return processing

    def with_pixels(self, min_pixels: int | None = None, max_pixels: int | None = None) -> ImageProcessing:
        """These pixel bounds where given (not None), the others kept."""
        bounds = {k: int(v) for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        return dataclasses.replace(self, **bounds)

    def smart_resize(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid_for_size(self, width: int, height: int) -> tuple[int, int, int]:
        """grid_thw of an image of this size (no pixels read)."""
        rows, cols = self.smart_resize(height, width)
        return 1, rows // self.patch_size, cols // self.patch_size

    def image_tokens(self, grid_thw) -> int:
        """Pad tokens of one image (or video frame block): its patches merged M x M."""
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // (self.merge_size * self.merge_size)

    def preprocess(self, image):
        """A PIL image -> (pixel_values float32 [patches, 3*T*P*P], grid_thw (t, h, w)) as numpy; equals
        transformers' (slow) Qwen2VLImageProcessor with these parameters."""
        from PIL import Image

        image = to_rgb(image)
        rows, cols = self.smart_resize(image.height, image.width)
        if (rows, cols) != (image.height, image.width):
            image = image.resize((cols, rows), resample=Image.BICUBIC)
        pixels = np.asarray(image).astype(np.float64) * (1 / 255)  # as transformers' rescale: float64, then float32
        pixels = pixels.astype(np.float32)
        pixels = (pixels - np.array(self.image_mean, dtype=np.float32)) / np.array(self.image_std, dtype=np.float32)
        return self.patchify(pixels.transpose(2, 0, 1))

    def patchify(self, chw: np.ndarray):
        """One frame [3, H, W] -> (patches [t*h*w, 3*T*P*P], (t, h, w)), the frame repeated to the temporal patch."""
        return self._patchify_frames(chw[None])

    def video_frames(self, frames):
        """A short video as PIL frames (one size) -> (pixel_values_videos float32 [grid_t*h*w, 3*T*P*P],
        grid_thw), as transformers 4.57's Qwen3VLVideoProcessor computes them: one size for the whole clip from
        the clip's volume (video_smart_resize), frames resized as torchvision does on the CPU (uint8 bicubic with
        antialias), rescale and normalisation fused into (x - 255*mean) / (255*std) in float32, frames taken T at
        a time, a count not divisible by T padded with copies of the last frame. Use the parameters of
        video_preprocessor_config.json (its pixel bounds are the clip's, not a frame's)."""
        import torch

        frames = list(frames)
        if len({f.size for f in frames}) > 1:
            raise ValueError(f"video frames of different sizes: {sorted({f.size for f in frames})}")
        clip = np.stack([np.asarray(to_rgb(f)) for f in frames])  # [n, H, W, 3]
        count, height, width = clip.shape[:3]
        rows, cols = video_smart_resize(count, height, width, self.factor, self.temporal_patch_size, self.min_pixels,
                                        self.max_pixels)
        video = torch.from_numpy(clip).permute(0, 3, 1, 2).contiguous()  # [n, 3, H, W] uint8
        if (rows, cols) != (height, width):
            video = torch.nn.functional.interpolate(video, size=[rows, cols], mode="bicubic", align_corners=False,
                                                    antialias=True)
        mean = torch.tensor(self.image_mean) * 255.0
        std = torch.tensor(self.image_std) * 255.0
        video = (video.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
        return self._patchify_frames(video.numpy())

    def _patchify_frames(self, frames: np.ndarray):
        # frames [n, C, H, W] -> grid_t = ceil(n / T) temporal patches, the last frame repeated to fill the last
        extra = -len(frames) % self.temporal_patch_size
        if extra:
            frames = np.concatenate([frames, np.repeat(frames[-1:], extra, axis=0)])
        count, channels, height, width = frames.shape
        m, p, tp = self.merge_size, self.patch_size, self.temporal_patch_size
        grid_t, grid_h, grid_w = count // tp, height // p, width // p
        x = frames.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
        # order: time, merged rows, merged cols, row in merge window, col in window | channel, frame, pixel row, col
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = x.reshape(grid_t * grid_h * grid_w, channels * tp * p * p)
        return np.ascontiguousarray(flat, dtype=np.float32), (grid_t, grid_h, grid_w)


QWEN2_5_VL = ImageProcessing()
# Qwen3-VL's published preprocessor_config.json (the Instruct and Thinking checkpoints)
QWEN3_VL = ImageProcessing(patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                           min_pixels=65536, max_pixels=16777216)
FAMILY_DEFAULTS = {"qwen2_5_vl": QWEN2_5_VL, "qwen3_vl": QWEN3_VL, "qwen3_vl_moe": QWEN3_VL}
TILED_FAMILIES = ("internvl", "internvl_chat")  # InternVL: dynamic tiling (models/internvl/tiles.Tiling)


def _tiling(config, directory=None):
    """InternVL's Tiling for our config (a converted checkpoint's preprocessor_config.json where `directory` is
    given, required there; the -hf values at the model's tile size for a tiny model)."""
    from mm_adaptor.models.internvl import config_from_hf
    from mm_adaptor.models.internvl.tiles import Tiling

    model = config_from_hf(config) if isinstance(config, dict) else config
    return Tiling.for_model(model, Tiling.for_directory(directory) if directory is not None else None)


def model_family(config) -> str | None:
    """model_type of an HF config dict or config object, else the family package of our config dataclasses
    (mm_adaptor.models.<family>.config)."""
    if isinstance(config, dict):
        return config.get("model_type")
    if isinstance(getattr(config, "model_type", None), str):
        return config.model_type
    parts = type(config).__module__.split(".")
    return parts[2] if parts[:2] == ["mm_adaptor", "models"] and len(parts) > 2 else None


def smart_resize(height: int, width: int, factor: int = PATCH_SIZE * MERGE_SIZE,
                 min_pixels: int = DEFAULT_MIN_PIXELS, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """(height, width) rounded to multiples of factor, the area within [min_pixels, max_pixels], the aspect ratio
    kept as near as the rounding allows (Python's round, as transformers)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} is over 200")
    rows = round(height / factor) * factor
    cols = round(width / factor) * factor
    if rows * cols > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        rows = max(factor, math.floor(height / shrink / factor) * factor)
        cols = max(factor, math.floor(width / shrink / factor) * factor)
    elif rows * cols < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        rows = math.ceil(height * grow / factor) * factor
        cols = math.ceil(width * grow / factor) * factor
    return rows, cols


def video_smart_resize(frames: int, height: int, width: int, factor: int, temporal_factor: int, min_pixels: int,
                       max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's frame size for a clip: as smart_resize, but the bounds hold the clip's volume (frames rounded to
    the temporal patch, times the frame's area), and too few frames, a side under factor or an aspect ratio over
    200 are errors (as in transformers)."""
    if frames < temporal_factor:
        raise ValueError(f"a video needs at least {temporal_factor} frames, got {frames}")
    if min(height, width) < factor:
        raise ValueError(f"video frames of {width}x{height}: both sides must be at least {factor}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} is over 200")
    rows, cols = round(height / factor) * factor, round(width / factor) * factor
    volume = round(frames / temporal_factor) * temporal_factor * rows * cols
    if volume > max_pixels:
        shrink = math.sqrt(frames * height * width / max_pixels)
        rows = max(factor, math.floor(height / shrink / factor) * factor)
        cols = max(factor, math.floor(width / shrink / factor) * factor)
    elif volume < min_pixels:
        grow = math.sqrt(min_pixels / (frames * height * width))
        rows = math.ceil(height * grow / factor) * factor
        cols = math.ceil(width * grow / factor) * factor
    return rows, cols


def frame_timestamps(frame_indices, fps: float, merge_size: int = 2) -> list[float]:
    """Seconds of each temporal patch as Qwen3VLProcessor writes them: the sampled frame indices padded with the
    last to a multiple of merge_size (transformers groups by the merge size, which equals the temporal patch 2),
    each group's first and last frame times averaged."""
    indices = [int(i) for i in frame_indices]
    indices += indices[-1:] * (-len(indices) % merge_size)
    return [(indices[i] / fps + indices[i + merge_size - 1] / fps) / 2 for i in range(0, len(indices), merge_size)]


def video_placeholder(timestamps, tokens_per_frame: int) -> str:
    """The text that replaces "<|vision_start|><|video_pad|><|vision_end|>" in Qwen3-VL's prompt: per temporal
    patch "<{seconds:.1f} seconds>" then a vision block of tokens_per_frame video pads."""
    block = "<|vision_start|>" + "<|video_pad|>" * tokens_per_frame + "<|vision_end|>"
    return "".join(f"<{seconds:.1f} seconds>{block}" for seconds in timestamps)


def grid_for_size(width: int, height: int, min_pixels: int = DEFAULT_MIN_PIXELS,
                  max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int, int]:
    """grid_thw of an image of this size, Qwen2.5-VL's parameters (the validation pass counts tokens with it)."""
    return QWEN2_5_VL.with_pixels(min_pixels, max_pixels).grid_for_size(width, height)


def image_tokens(grid_thw) -> int:
    """Image-pad tokens of one image: its patches merged 2x2."""
    return QWEN2_5_VL.image_tokens(grid_thw)


def preprocess(image, min_pixels: int = DEFAULT_MIN_PIXELS, max_pixels: int = DEFAULT_MAX_PIXELS):
    """A PIL image -> (pixel_values float32 [patches, 1176], grid_thw (t, h, w)) as numpy, Qwen2.5-VL's parameters."""
    return QWEN2_5_VL.with_pixels(min_pixels, max_pixels).preprocess(image)


def patchify(chw: np.ndarray):
    """One frame [3, H, W] -> (patches [t*h*w, 3*2*14*14], (t, h, w)), the frame repeated to the temporal patch."""
    return QWEN2_5_VL.patchify(chw)


def _model_sizes(config) -> dict:
    # the patch geometry a model config names (ours flat, transformers' in vision_config)
    sources = [config.get("vision_config") or {}, config] if isinstance(config, dict) else \
        [getattr(config, "vision_config", None), config]
    sizes = {}
    for ours, names in (("patch_size", ("patch_size",)), ("merge_size", ("spatial_merge_size", "merge_size")),
                        ("temporal_patch_size", ("temporal_patch_size",))):
        for source in sources:
            for name in names:
                value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
                if value is not None and ours not in sizes:
                    sizes[ours] = int(value)
    return sizes
