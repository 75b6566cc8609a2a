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
from pathlib import Path

import numpy as np

from mm_adaptor.data import pixels
from mm_adaptor.data.pixels import refuse_unsupported as _refuse_unsupported, to_rgb  # noqa: F401
from mm_adaptor.data.video import frame_timestamps, video_placeholder, video_smart_resize  # noqa: F401

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
    video: object = None  # data.video.VideoProcessing: how records' videos are read (None: videos are refused)

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
        found = {name: config[name] for name in _SETTINGS if config.get(name) is not None}
        for ours, theirs in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if ours not in found and size.get(theirs) is not None:
                found[ours] = size[theirs]
        missing = [name for name in _SETTINGS if name not in found]
        if missing and defaults is None:
            raise ValueError(f"the preprocessor config lacks {', '.join(missing)} (min_pixels/max_pixels may be "
                             f"given as size shortest_edge/longest_edge)")
        values = {name: getattr(defaults, name) for name in missing}
        values.update(found, video=defaults.video if defaults is not None else None)
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
        return with_video(dataclasses.replace(FAMILY_DEFAULTS[family], **_model_sizes(config)), family)

    @classmethod
    def for_directory(cls, directory, config, video: bool = False) -> ImageProcessing:
        """A converted checkpoint's preprocessing: DIR/preprocessor_config.json (video: video_preprocessor_config.json)
        for Qwen3-VL, required, its patch, merge and temporal sizes checked against the model config's; its
        videos' from video_preprocessor_config.json where the directory has one. Qwen2.5-VL
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
        video_path = Path(directory) / VIDEO_PREPROCESSOR_CONFIG
        if video or not video_path.is_file():  # without the file, a record's video is refused naming it
            return processing
        cls.for_directory(directory, config, video=True)  # its sizes checked against the model's
        return with_video(processing, family, json.loads(video_path.read_text()))

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
        """A short video as PIL frames (one size) -> (pixel_values_videos, grid_thw) with Qwen3-VL's clip size
        (video_smart_resize: one size for the whole clip from its volume); see video_pixels. Use the parameters of
        video_preprocessor_config.json (its pixel bounds are the clip's, not a frame's)."""
        frames = list(frames)
        if len({f.size for f in frames}) > 1:
            raise ValueError(f"video frames of different sizes: {sorted({f.size for f in frames})}")
        clip = np.stack([np.asarray(to_rgb(f)) for f in frames])  # [n, H, W, 3]
        count, height, width = clip.shape[:3]
        return self.video_pixels(clip, video_smart_resize(count, height, width, self.factor, self.temporal_patch_size,
                                                          self.min_pixels, self.max_pixels))

    def video_pixels(self, clip: np.ndarray, size):
        """Frames uint8 RGB [n, H, W, 3] -> (pixel_values_videos float32 [grid_t*h*w, 3*T*P*P], grid_thw), as
        transformers' Qwen2-VL and Qwen3-VL video processors compute them once they have the frame size `size`
        (rows, cols): frames resized as torchvision does on the CPU (uint8 bicubic with antialias), rescale and
        normalisation fused into (x - 255*mean) / (255*std) in float32, frames taken T at a time, a count not
        divisible by T padded with copies of the last frame."""
        import torch

        rows, cols = size
        video = torch.from_numpy(np.ascontiguousarray(clip)).permute(0, 3, 1, 2).contiguous()  # [n, 3, H, W] uint8
        if (rows, cols) != tuple(video.shape[-2:]):
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


def with_video(processing: ImageProcessing, family: str, video_config: dict | None = None) -> ImageProcessing:
    """processing with its family's video processing: the video processor class's defaults (pixel bounds, fps 2,
    4 to 768 frames) over the image sizes and statistics, or those of a video_preprocessor_config.json's dict."""
    from mm_adaptor.data import video as video_ops

    rules = "qwen2_5_vl" if family == "qwen2_5_vl" else "qwen3_vl"
    low, high = video_ops.QWEN2_5_VL_VIDEO_PIXELS if rules == "qwen2_5_vl" else video_ops.QWEN3_VL_VIDEO_PIXELS
    frames = dataclasses.replace(processing, min_pixels=low, max_pixels=high, video=None)
    sampling = {}
    if video_config is not None:
        frames = ImageProcessing.from_preprocessor_config(video_config, defaults=frames)
        sampling = {name: type(default)(video_config[name]) for name, default in
                    (("fps", 2.0), ("min_frames", 4), ("max_frames", 768)) if video_config.get(name) is not None}
    return dataclasses.replace(processing, video=video_ops.VideoProcessing(rules, frames, **sampling))


TILED_FAMILIES = ("internvl", "internvl_chat")  # InternVL: dynamic tiling (models/internvl/tiles.Tiling)
QWEN2_5_VL = with_video(ImageProcessing(), "qwen2_5_vl")
# Qwen3-VL's published preprocessor_config.json (the Instruct and Thinking checkpoints)
QWEN3_VL = with_video(ImageProcessing(patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                                     min_pixels=65536, max_pixels=16777216), "qwen3_vl")
FAMILY_DEFAULTS = {"qwen2_5_vl": QWEN2_5_VL, "qwen3_vl": QWEN3_VL, "qwen3_vl_moe": QWEN3_VL}
_SETTINGS = [f.name for f in dataclasses.fields(ImageProcessing) if f.name != "video"]


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
    """pixels.smart_resize with Qwen2.5-VL's defaults."""
    return pixels.smart_resize(height, width, factor, min_pixels, max_pixels)


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
