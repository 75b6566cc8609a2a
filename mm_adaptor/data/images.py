"""Qwen2.5-VL image preprocessing with PIL and numpy only (transformers' Qwen2VLImageProcessor defines the result).

An image becomes pixel_values [grid_t*grid_h*grid_w, 3*2*14*14] (float32) and grid_thw (grid_t, grid_h, grid_w):
resized to multiples of patch*merge (28) by `smart_resize`, RGB, bicubic, scaled to [0, 1], normalised with CLIP's
mean/std, the one frame repeated to the temporal patch (2), patches in transformers' flatten order."""

from __future__ import annotations

import math

import numpy as np

IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2


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


def grid_for_size(width: int, height: int, min_pixels: int = DEFAULT_MIN_PIXELS,
                  max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int, int]:
    """grid_thw of an image of this size (no pixels read; the validation pass counts tokens with it)."""
    rows, cols = smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
    return 1, rows // PATCH_SIZE, cols // PATCH_SIZE


def image_tokens(grid_thw) -> int:
    """Image-pad tokens of one image: its patches merged 2x2."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // (MERGE_SIZE * MERGE_SIZE)


def preprocess(image, min_pixels: int = DEFAULT_MIN_PIXELS, max_pixels: int = DEFAULT_MAX_PIXELS):
    """A PIL image -> (pixel_values float32 [patches, 1176], grid_thw (t, h, w)) as numpy."""
    from PIL import Image

    if image.mode != "RGB":
        image = image.convert("RGB")  # as transformers' convert_to_rgb
    rows, cols = smart_resize(image.height, image.width, min_pixels=min_pixels, max_pixels=max_pixels)
    if (rows, cols) != (image.height, image.width):
        image = image.resize((cols, rows), resample=Image.BICUBIC)
    pixels = np.asarray(image).astype(np.float64) * (1 / 255)  # as transformers' rescale: float64, then float32
    pixels = pixels.astype(np.float32)
    pixels = (pixels - np.array(IMAGE_MEAN, dtype=np.float32)) / np.array(IMAGE_STD, dtype=np.float32)
    return patchify(pixels.transpose(2, 0, 1))


def patchify(chw: np.ndarray):
    """One frame [3, H, W] -> (patches [t*h*w, 3*2*14*14], (t, h, w)), the frame repeated to the temporal patch."""
    channels, height, width = chw.shape
    frames = np.repeat(chw[None], TEMPORAL_PATCH_SIZE, axis=0)  # [2, 3, H, W]
    grid_t, grid_h, grid_w = 1, height // PATCH_SIZE, width // PATCH_SIZE
    m, p = MERGE_SIZE, PATCH_SIZE
    x = frames.reshape(grid_t, TEMPORAL_PATCH_SIZE, channels, grid_h // m, m, p, grid_w // m, m, p)
    # order: time, merged rows, merged cols, row in merge window, col in window | channel, frame, pixel row, col
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = x.reshape(grid_t * grid_h * grid_w, channels * TEMPORAL_PATCH_SIZE * p * p)
    return np.ascontiguousarray(flat, dtype=np.float32), (grid_t, grid_h, grid_w)

