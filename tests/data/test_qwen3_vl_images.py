"""Preprocessing with parameters read from the checkpoint: Qwen3-VL's images equal transformers' (slow)
Qwen2VLImageProcessor given Qwen3-VL's preprocessor_config.json values, both spellings of the pixel bounds are read,
Qwen2.5-VL's defaults are unchanged.

Videos: transformers' Qwen3VLVideoProcessor needs torchvision, which this environment lacks, so `video_frames` is
checked against a reading of its source (transformers 4.57, video_processing_qwen3_vl.py): the clip size equals its
smart_resize (importable without torchvision); the patch values equal an independent numpy computation (a loop
over patches, not the reshape/transpose of the module) of (x - 127.5) / 127.5 in float32 with the last frame
repeated to an even count; resized frames equal torch's uint8 bicubic antialiased interpolation of each frame,
which is what torchvision >= 0.16 runs for uint8 on the CPU (on CUDA it resizes in float32 and rounds, which can
differ by a few levels)."""

import json
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from hf_compat import slow_qwen2_vl_image_processor  # noqa: E402

Qwen2VLImageProcessor = slow_qwen2_vl_image_processor()

from mm_adaptor.data import images  # noqa: E402
from mm_adaptor.data.images import ImageProcessing  # noqa: E402

# Qwen3-VL-*-Instruct's preprocessor_config.json and video_preprocessor_config.json (the fields that matter)
QWEN3_VL_FILE = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                 "image_processor_type": "Qwen2VLImageProcessorFast"}
QWEN3_VL_VIDEO_FILE = dict(QWEN3_VL_FILE, size={"longest_edge": 25165824, "shortest_edge": 4096})
QWEN2_5_VL_FILE = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                   "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                   "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor"}


def _random_image(width, height, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(array[..., 0] if channels == 1 else array, mode)


def _transformers(processing, image):
    # min_pixels/max_pixels, not size: 4.57's slow constructor replaces a given size with its defaults
    processor = Qwen2VLImageProcessor(patch_size=processing.patch_size, merge_size=processing.merge_size,
                                      temporal_patch_size=processing.temporal_patch_size,
                                      image_mean=list(processing.image_mean), image_std=list(processing.image_std),
                                      min_pixels=processing.min_pixels, max_pixels=processing.max_pixels)
    return processor(images=[image], return_tensors="np")


QWEN3 = images.with_video(ImageProcessing.from_preprocessor_config(QWEN3_VL_FILE), "qwen3_vl")
SMALL_BOUNDS = QWEN3.with_pixels(32 * 32 * 4, 32 * 32 * 48)  # resizing both ways at small sizes


@pytest.mark.parametrize("processing,width,height,mode", [
    (QWEN3, 300, 140, "RGB"), (QWEN3, 333, 1000, "RGB"), (QWEN3, 640, 480, "RGBA"), (QWEN3, 100, 37, "L"),
    (SMALL_BOUNDS, 700, 260, "RGB"), (SMALL_BOUNDS, 45, 90, "RGB"), (SMALL_BOUNDS, 256, 512, "RGB")])
def test_qwen3_vl_pixels_and_grid_equal_transformers(processing, width, height, mode):
    image = _random_image(width, height, mode, seed=width)
    ours, grid = processing.preprocess(image)
    theirs = _transformers(processing, image)
    assert tuple(theirs["image_grid_thw"][0]) == grid
    assert ours.shape == theirs["pixel_values"].shape and ours.shape[1] == 3 * 2 * 16 * 16
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, theirs["pixel_values"])
    assert processing.grid_for_size(width, height) == grid
    assert processing.image_tokens(grid) * 4 == ours.shape[0]


def test_reading_both_spellings_of_the_pixel_bounds():
    assert QWEN3 == images.QWEN3_VL == images.with_video(
        ImageProcessing(16, 2, 2, (0.5,) * 3, (0.5,) * 3, 65536, 16777216), "qwen3_vl")
    old = ImageProcessing.from_preprocessor_config(QWEN2_5_VL_FILE)
    assert (old.min_pixels, old.max_pixels, old.patch_size, old.image_mean) == (3136, 12845056, 14, images.IMAGE_MEAN)
    both = dict(QWEN3_VL_FILE, min_pixels=1024, max_pixels=2048)  # min/max_pixels win, as in transformers
    assert ImageProcessing.from_preprocessor_config(both) == replace(QWEN3.with_pixels(1024, 2048), video=None)
    video = ImageProcessing.from_preprocessor_config(QWEN3_VL_VIDEO_FILE)
    assert (video.min_pixels, video.max_pixels) == (4096, 25165824)
    with pytest.raises(ValueError, match="lacks image_mean, image_std, min_pixels, max_pixels"):
        ImageProcessing.from_preprocessor_config({"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2})
    partial = ImageProcessing.from_preprocessor_config({"size": {"shortest_edge": 10, "longest_edge": 20}}, QWEN3)
    assert partial == QWEN3.with_pixels(10, 20)
    with pytest.raises(ValueError, match="resample=2 is not supported"):
        ImageProcessing.from_preprocessor_config(dict(QWEN3_VL_FILE, resample=2))


def test_qwen2_5_vl_defaults_unchanged():
    from mm_adaptor.models.qwen2_5_vl import tiny_config, tiny_hf_config_dict

    default = images.with_video(ImageProcessing(), "qwen2_5_vl")
    assert default == images.QWEN2_5_VL == ImageProcessing.for_model(tiny_config())
    assert default == ImageProcessing.for_model(tiny_hf_config_dict())
    assert (default.patch_size, default.merge_size, default.temporal_patch_size) == (14, 2, 2)
    assert (default.image_mean, default.image_std) == (images.IMAGE_MEAN, images.IMAGE_STD)
    assert (default.min_pixels, default.max_pixels) == (56 * 56, 28 * 28 * 1280)
    image = _random_image(300, 140)
    for bounds in ((), (28 * 28 * 4, 28 * 28 * 96)):
        values, grid = images.preprocess(image, *bounds)
        theirs = Qwen2VLImageProcessor(**dict(zip(("min_pixels", "max_pixels"), bounds)))(images=[image],
                                                                                         return_tensors="np")
        np.testing.assert_array_equal(values, theirs["pixel_values"])
        assert values.shape[1] == 1176 and grid == tuple(theirs["image_grid_thw"][0])
        assert images.grid_for_size(300, 140, *bounds) == grid


def test_for_model_and_for_directory(tmp_path):
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig

    from mm_adaptor.models.qwen2_5_vl import tiny_config

    hf_config = Qwen3VLConfig()
    assert ImageProcessing.for_model(hf_config) == QWEN3
    assert ImageProcessing.for_model({"model_type": "qwen3_vl_moe"}) == QWEN3
    with pytest.raises(ValueError, match="missing: a qwen3_vl checkpoint's preprocessing"):
        ImageProcessing.for_directory(tmp_path, hf_config)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(dict(QWEN3_VL_FILE, size={
        "shortest_edge": 1024, "longest_edge": 4096})))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(QWEN3_VL_VIDEO_FILE))
    found = ImageProcessing.for_directory(tmp_path, hf_config)
    assert replace(found, video=None) == replace(QWEN3.with_pixels(1024, 4096), video=None)
    assert (found.video.frames.min_pixels, found.video.frames.max_pixels) == (4096, 25165824)  # the video file's
    assert ImageProcessing.for_directory(tmp_path, hf_config, video=True).min_pixels == 4096
    (tmp_path / "video_preprocessor_config.json").unlink()
    assert ImageProcessing.for_directory(tmp_path, hf_config).video is None  # a record's video is refused
    with pytest.raises(ValueError, match="does not fit the model: patch_size 16 .model: 14."):
        ImageProcessing.for_directory(tmp_path, {"model_type": "qwen3_vl", "vision_config": {"patch_size": 14}})
    assert ImageProcessing.for_directory(tmp_path, tiny_config()) == images.QWEN2_5_VL  # Qwen2.5-VL: defaults


def _numpy_patches(frames, patch, merge, temporal, mean, std):
    """pixel_values_videos by a loop over the patches, frames [n, H, W, 3] float32 in [0, 255]."""
    frames = list(frames) + [frames[-1]] * (-len(frames) % temporal)
    grid_t, grid_h, grid_w = len(frames) // temporal, frames[0].shape[0] // patch, frames[0].shape[1] // patch
    rows = []
    for t in range(grid_t):
        for block_r in range(grid_h // merge):
            for block_c in range(grid_w // merge):
                for r in range(merge):
                    for c in range(merge):
                        y, x = (block_r * merge + r) * patch, (block_c * merge + c) * patch
                        cube = np.stack([frames[t * temporal + k][y:y + patch, x:x + patch] for k in range(temporal)])
                        cube = (cube - np.float32(255 * mean)) / np.float32(255 * std)  # [temporal, p, p, 3]
                        rows.append(cube.transpose(3, 0, 1, 2).reshape(-1))  # channel, frame, row, column
    return np.stack(rows).astype(np.float32), (grid_t, grid_h, grid_w)


@pytest.mark.parametrize("count,width,height", [(4, 96, 64), (5, 64, 128), (3, 70, 50), (2, 200, 41)])
def test_video_frames(count, width, height):
    import torch
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_video_smart_resize

    video = ImageProcessing.from_preprocessor_config(QWEN3_VL_VIDEO_FILE)
    frames = [_random_image(width, height, seed=i) for i in range(count)]
    ours, grid = video.video_frames(frames)
    size = hf_video_smart_resize(count, height, width, 2, 32, video.min_pixels, video.max_pixels)
    assert size == images.video_smart_resize(count, height, width, 32, 2, video.min_pixels, video.max_pixels)
    arrays = [np.asarray(f) for f in frames]
    if size != (height, width):
        arrays = [torch.nn.functional.interpolate(torch.from_numpy(a.copy()).permute(2, 0, 1)[None], size=list(size),
                                                  mode="bicubic", antialias=True)[0].permute(1, 2, 0).numpy()
                  for a in arrays]
    expected, expected_grid = _numpy_patches([a.astype(np.float32) for a in arrays], 16, 2, 2, 0.5, 0.5)
    assert grid == expected_grid == (-(-count // 2), size[0] // 16, size[1] // 16)
    np.testing.assert_array_equal(ours, expected)
    if count % 2:  # the last temporal patch holds the last frame twice
        last = ours[-1].reshape(3, 2, 16, 16)
        np.testing.assert_array_equal(last[:, 0], last[:, 1])


def test_video_refusals_and_timestamps():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    video = ImageProcessing.from_preprocessor_config(QWEN3_VL_VIDEO_FILE)
    with pytest.raises(ValueError, match="at least 2 frames"):
        video.video_frames([_random_image(64, 64)])
    with pytest.raises(ValueError, match="both sides must be at least 32"):
        video.video_frames([_random_image(64, 20)] * 2)
    with pytest.raises(ValueError, match="different sizes"):
        video.video_frames([_random_image(64, 64), _random_image(64, 96)])
    for indices, fps in (([0, 1, 2, 3], 2.0), ([0, 12, 24, 36, 48], 24.0), ([3, 7, 11], 29.97)):
        assert images.frame_timestamps(indices, fps) == Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps)


def test_data_pipeline_takes_the_processing(shapes, byte_setup):
    """validate/load_sample with Qwen3-VL's preprocessing: its grids, its 1536 values a patch, its pad counts;
    the same calls without it keep Qwen2.5-VL's."""
    from mm_adaptor.data.vlm import encode, load_sample, validate

    tokenizer, _ = byte_setup
    processing = QWEN3.with_pixels(32 * 32 * 4, 32 * 32 * 16)
    report = validate(shapes, tokenizer, 4096, max_samples=3, processing=processing)
    old = validate(shapes, tokenizer, 4096, max_samples=3)
    for sample, old_sample in zip(report.samples, old.samples):
        ids, _, pixels, grids, *_ = load_sample(sample, tokenizer, None, None, processing)
        with Image.open(sample.record.images[0]) as image:
            expected, grid = processing.preprocess(image)
            assert grids == [processing.grid_for_size(*image.size)] == [grid]
            assert old_sample.grids == [images.grid_for_size(*image.size)]
        np.testing.assert_array_equal(pixels.numpy(), expected)
        assert pixels.shape[1] == 1536
        assert ids.count(tokenizer.special_ids["<|image_pad|>"]) == processing.image_tokens(grid)
        assert encode(sample.record, grids, tokenizer, processing)[0] == ids
        _, _, old_pixels, *_ = load_sample(old_sample, tokenizer, images.DEFAULT_MIN_PIXELS, images.DEFAULT_MAX_PIXELS)
        assert old_pixels.shape[1] == 1176


def test_for_model_of_our_qwen3_vl_config():
    ours = pytest.importorskip("mm_adaptor.models.qwen3_vl.config")
    assert ImageProcessing.for_model(ours.Qwen3VLConfig()) == QWEN3
    assert ImageProcessing.for_model(ours.Qwen3VLConfig(num_experts=8)) == QWEN3  # qwen3_vl_moe
