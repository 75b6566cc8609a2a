"""Pixel-level steps every family's preprocessing shares (Qwen's patches in data.images, InternVL's tiles in
models/internvl/tiles.py, videos in data.video): RGB as transformers makes it, the preprocessor settings none of
them implements, and Qwen's smart_resize of an image or a video frame."""

from __future__ import annotations

import math


def to_rgb(image):
    """RGB as transformers 5.x's convert_to_rgb: transparency composited onto white (4.57 dropped the alpha channel,
    so a transparent pixel kept its hidden colour)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def refuse_unsupported(config: dict) -> None:
    """One line naming a preprocessor setting that none of the families' preprocessing here implements."""
    settings = {"do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "resample": 3}
    for name, wanted in settings.items():
        if name in config and config[name] is not None and config[name] != wanted:
            raise ValueError(f"preprocessor config {name}={config[name]!r} is not supported (only {wanted!r})")
    factor = config.get("rescale_factor")
    if factor is not None and not math.isclose(float(factor), 1 / 255, rel_tol=1e-9):
        raise ValueError(f"preprocessor config rescale_factor={factor} is not supported (only 1/255)")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
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
