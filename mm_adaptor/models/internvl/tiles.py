"""InternVL's image preprocessing with PIL and numpy, as transformers' InternVLProcessor prepares images (its
GotOcr2ImageProcessor with crop_to_patches, which the processor turns on whatever the file says):

- dynamic tiling: the (columns, rows) grid with min_patches <= columns * rows <= max_patches whose aspect ratio is
  nearest the image's (a tie goes to the grid with more tiles while the image's area exceeds half the tiles'); the
  image resized (bicubic, uint8) to the grid and cut row by row into tiles, plus a thumbnail (the whole image
  resized to one tile) when there is more than one tile;
- RGB (transparency composited onto white, data.pixels.to_rgb), scaled to [0, 1], normalised with the file's
  mean/std; pixel_values [tiles, 3, S, S] float32;
- each image's text: <img>, image_seq_length <IMG_CONTEXT> per tile, </img>."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


NO_PIXEL_BOUNDS = (1, 1 << 62)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The tiling parameters and operations; it answers the data tools as data.images.ImageProcessing does, an
    image's "grid" being (tiles, 1, 1)."""
    tile_size: int = 448
    min_patches: int = 1
    max_patches: int = 12
    image_mean: tuple = IMAGENET_MEAN
    image_std: tuple = IMAGENET_STD
    tokens_per_tile: int = 256  # the model's image_seq_length
    min_pixels, max_pixels = NO_PIXEL_BOUNDS  # (class constants: tiling has no pixel bounds)

    @classmethod
    def for_model(cls, config, tiling: Tiling | None = None) -> Tiling:
        """`tiling` (default: InternVL's -hf values with the model's tile size) with the model's tokens per tile."""
        tiling = tiling or cls(tile_size=config.image_size)
        return dataclasses.replace(tiling, tokens_per_tile=config.tokens_per_tile(tiling.tile_size))

    def preprocessor_config(self) -> dict:
        """preprocessor_config.json as the -hf checkpoints write it (GotOcr2ImageProcessor)."""
        return {"image_processor_type": "GotOcr2ImageProcessor", "crop_to_patches": False,
                "size": {"height": self.tile_size, "width": self.tile_size}, "min_patches": self.min_patches,
                "max_patches": self.max_patches, "image_mean": list(self.image_mean),
                "image_std": list(self.image_std), "do_resize": True, "do_rescale": True, "do_normalize": True,
                "do_convert_rgb": True, "rescale_factor": 1 / 255, "resample": 3}

    def with_pixels(self, min_pixels: int | None = None, max_pixels: int | None = None) -> Tiling:
        if (min_pixels, max_pixels) not in ((None, None), NO_PIXEL_BOUNDS):
            raise ValueError("InternVL tiles its images: image pixel bounds do not apply")
        return self

    def grid_for_size(self, width: int, height: int) -> tuple[int, int, int]:
        return self.tile_count(width, height), 1, 1

    def image_tokens(self, grid) -> int:
        return int(grid[0]) * self.tokens_per_tile

    @classmethod
    def from_preprocessor_config(cls, config: dict) -> Tiling:
        """From a -hf checkpoint's preprocessor_config.json (GotOcr2ImageProcessor's fields); every field required
        (the class's own defaults, 384 px and CLIP's statistics, are not InternVL's)."""
        from mm_adaptor.data.pixels import refuse_unsupported as _refuse_unsupported

        _refuse_unsupported(config)
        size = config.get("size") or {}
        missing = [name for name in ("image_mean", "image_std") if config.get(name) is None]
        if size.get("height") is None or size.get("height") != size.get("width"):
            missing.append("size {height, width} (square)")
        if missing:
            raise ValueError(f"the InternVL preprocessor config lacks {', '.join(missing)}")
        return cls(tile_size=int(size["height"]), min_patches=int(config.get("min_patches", 1)),
                   max_patches=int(config.get("max_patches", 12)), image_mean=tuple(config["image_mean"]),
                   image_std=tuple(config["image_std"]))

    @classmethod
    def for_directory(cls, directory) -> Tiling:
        path = Path(directory) / "preprocessor_config.json"
        if not path.is_file():
            raise ValueError(f"{path} is missing: an InternVL checkpoint's tiling (tile size, mean/std, patches) "
                             "must come from it; copy it from the Hugging Face model directory")
        return cls.from_preprocessor_config(json.loads(path.read_text()))

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(columns, rows) of tiles for an image of this size."""
        candidates = sorted(((c, r) for c in range(1, self.max_patches + 1) for r in range(1, self.max_patches + 1)
                             if self.min_patches <= c * r <= self.max_patches), key=lambda g: g[0] * g[1])
        aspect, area = width / height, width * height
        best, best_diff = (1, 1), float("inf")
        for columns, rows in candidates:
            diff = abs(aspect - columns / rows)
            if diff < best_diff:
                best, best_diff = (columns, rows), diff
            elif diff == best_diff and area > 0.5 * self.tile_size**2 * columns * rows:
                best = (columns, rows)
        return best

    def tile_count(self, width: int, height: int) -> int:
        columns, rows = self.grid(width, height)
        return columns * rows + (1 if columns * rows > 1 else 0)

    def tiles(self, image) -> list:
        """The PIL tiles of one image (RGB), thumbnail last."""
        from PIL import Image

        from mm_adaptor.data.pixels import to_rgb

        image = to_rgb(image)
        columns, rows = self.grid(image.width, image.height)
        s = self.tile_size
        canvas = image.resize((columns * s, rows * s), resample=Image.BICUBIC)
        out = [canvas.crop((c * s, r * s, (c + 1) * s, (r + 1) * s)) for r in range(rows) for c in range(columns)]
        if len(out) > 1:
            out.append(image.resize((s, s), resample=Image.BICUBIC))
        return out

    def preprocess(self, image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """A PIL image -> (pixel_values float32 [tiles, 3, S, S], (tiles, 1, 1))."""
        pixels = np.stack([np.asarray(tile) for tile in self.tiles(image)]).astype(np.float64) * (1 / 255)
        pixels = pixels.astype(np.float32)  # as transformers' rescale: float64, then float32
        pixels = (pixels - np.array(self.image_mean, dtype=np.float32)) / np.array(self.image_std, dtype=np.float32)
        return np.ascontiguousarray(pixels.transpose(0, 3, 1, 2)), (pixels.shape[0], 1, 1)


def image_text(tiles: int, tokens_per_tile: int, start: str = "<img>", context: str = "<IMG_CONTEXT>",
               end: str = "</img>") -> str:
    """One image's placeholder text in the prompt."""
    return start + context * (tokens_per_tile * tiles) + end
