"""Image preprocessing equals transformers' Qwen2VLImageProcessor (the slow one; no torchvision needed)."""

import numpy as np
import pytest

pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from hf_compat import slow_module, slow_qwen2_vl_image_processor  # noqa: E402

Qwen2VLImageProcessor = slow_qwen2_vl_image_processor()
hf_smart_resize = slow_module().smart_resize

from mm_adaptor.data import images  # noqa: E402


def _random_image(width, height, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(array[..., 0] if channels == 1 else array, mode)


@pytest.mark.parametrize("height,width", [(112, 112), (100, 300), (57, 1000), (2000, 30), (1080, 1920), (29, 29),
                                          (10, 10), (3000, 4000), (123, 457)])
def test_smart_resize_equals_transformers(height, width):
    for bounds in ((56 * 56, 28 * 28 * 1280), (28 * 28 * 16, 28 * 28 * 64)):
        assert images.smart_resize(height, width, 28, *bounds) == hf_smart_resize(height, width, 28, *bounds)


@pytest.mark.parametrize("width,height,mode", [(112, 112, "RGB"), (300, 140, "RGB"), (130, 257, "RGBA"),
                                               (640, 480, "L"), (57, 200, "RGB")])
def test_pixels_and_grid_equal_transformers(width, height, mode):
    min_pixels, max_pixels = 28 * 28 * 4, 28 * 28 * 96  # small bounds so that resizing happens both ways
    image = _random_image(width, height, mode)
    ours, grid = images.preprocess(image, min_pixels, max_pixels)
    processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    theirs = processor(images=[image], return_tensors="np")
    assert tuple(theirs["image_grid_thw"][0]) == grid
    assert ours.shape == theirs["pixel_values"].shape and ours.dtype == np.float32
    # measured: bit-identical (same PIL resize, same float64 rescale, same float32 normalisation)
    np.testing.assert_array_equal(ours, theirs["pixel_values"])
    assert images.grid_for_size(width, height, min_pixels, max_pixels) == grid
    assert images.image_tokens(grid) * 4 == ours.shape[0]
