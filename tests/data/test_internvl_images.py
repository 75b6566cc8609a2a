"""InternVL's tiling (mm_adaptor/models/internvl/tiles.py) equals transformers' InternVL image processor
(GotOcr2ImageProcessor with crop_to_patches, as InternVLProcessor calls it) bit for bit: pixel values and tile
counts, on a tiny image, extreme aspect ratios both ways, grayscale, opaque RGBA, palette and a large image, with
the -hf checkpoints' values (448 px tiles, ImageNet statistics, 1 .. 12 tiles) and a small tile size."""

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from mm_adaptor.models.internvl.tiles import Tiling, image_text  # noqa: E402

HF_PREPROCESSOR = {  # OpenGVLab/InternVL3-1B-hf's preprocessor_config.json values
    "crop_to_patches": False, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225], "max_patches": 12, "min_patches": 1,
    "rescale_factor": 0.00392156862745098, "resample": 3, "size": {"height": 448, "width": 448},
    "image_processor_type": "GotOcr2ImageProcessor",
}


def _picture(kind: str, width: int, height: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    if kind == "L":
        return Image.fromarray(rgb[..., 0], "L")
    if kind == "RGBA":  # opaque: 4.57 drops the alpha channel, 5.x composites onto white; both agree on it
        return Image.fromarray(np.dstack([rgb, np.full((height, width), 255, np.uint8)]), "RGBA")
    if kind == "P":
        return Image.fromarray(rgb).convert("P")
    return Image.fromarray(rgb)


CASES = {  # name: (mode, width, height, tile size)
    "tiny": ("RGB", 7, 5, 448),  # 3 rows would be read as channels first by transformers
    "extreme_wide": ("RGB", 1000, 40, 448),
    "extreme_tall": ("RGB", 30, 900, 448),
    "grayscale": ("L", 700, 500, 448),
    "rgba": ("RGBA", 300, 600, 448),
    "palette": ("P", 90, 60, 28),
    "large": ("RGB", 1920, 1080, 448),
    "small_tiles_square": ("RGB", 60, 60, 28),
}


def _transformers_processor(tile: int):
    try:
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil as found
    except ImportError:
        from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor as found
    values = {k: v for k, v in HF_PREPROCESSOR.items() if k not in ("image_processor_type", "crop_to_patches")}
    return found(**{**values, "size": {"height": tile, "width": tile}})


@pytest.mark.parametrize("case", CASES)
def test_tiles_equal_transformers(case):
    mode, width, height, tile = CASES[case]
    picture = _picture(mode, width, height)
    ours = Tiling.from_preprocessor_config({**HF_PREPROCESSOR, "size": {"height": tile, "width": tile}})
    pixels, grid = ours.preprocess(picture)
    expected = _transformers_processor(tile)(images=[picture], crop_to_patches=True, return_tensors="pt")
    assert pixels.shape[0] == ours.tile_count(width, height) == int(expected["num_patches"][0]) == grid[0]
    assert torch.equal(torch.from_numpy(pixels), expected["pixel_values"])


def test_tile_counts_and_grids():
    """Known grids: a square image gives one tile; 2:1 two plus the thumbnail; 25:1 the widest grid (12 x 1)."""
    tiling = Tiling()
    assert (tiling.grid(448, 448), tiling.tile_count(448, 448)) == ((1, 1), 1)
    assert (tiling.grid(896, 448), tiling.tile_count(896, 448)) == ((2, 1), 3)
    assert tiling.grid(1000, 40) == (12, 1) and tiling.tile_count(1000, 40) == 13
    assert image_text(2, 3) == "<img>" + "<IMG_CONTEXT>" * 6 + "</img>"


def test_preprocessor_config_is_required_and_checked():
    with pytest.raises(ValueError, match="lacks image_mean"):
        Tiling.from_preprocessor_config({k: v for k, v in HF_PREPROCESSOR.items() if k != "image_mean"})
    with pytest.raises(ValueError, match="resample=2 is not supported"):
        Tiling.from_preprocessor_config({**HF_PREPROCESSOR, "resample": 2})
    wrong = Tiling(image_mean=(0.5, 0.5, 0.5))
    picture = _picture("RGB", 50, 40)
    expected = _transformers_processor(448)(images=[picture], crop_to_patches=True, return_tensors="pt")
    assert not torch.equal(torch.from_numpy(wrong.preprocess(picture)[0]), expected["pixel_values"])


def _data_check(argv, capsys):
    from mm_adaptor.cli import main as cli_main

    code = cli_main(["data", "check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_data_check_takes_internvl_from_model_or_checkpoint(shapes, tmp_path, capsys):
    """`mm-adaptor data check --model internvl-tiny` (or --load of a converted InternVL directory) counts tokens
    with InternVL's tiling (<img>, 4 <IMG_CONTEXT> per 28 px tile with the thumbnail, </img>) and the model's ids:
    the longest sample's count is the one the library gives with that tiling, not Qwen2.5-VL's."""
    from mm_adaptor.data import load_tokenizer, validate
    from mm_adaptor.models.internvl import tiny_config, tiny_hf_config_dict

    config = tiny_config()
    tiled = validate(shapes, load_tokenizer(None, config), 10**6, processing=Tiling.for_model(config))
    longest = max(s.length for s in tiled.samples)
    qwen = max(s.length for s in validate(shapes, load_tokenizer(None), 10**6).samples)
    assert longest != qwen and all(s.grids[0][0] > 1 for s in tiled.samples)  # tiles with the thumbnail
    for flags in (["--model", "internvl-tiny"], ["--load", str(tmp_path)]):
        if flags[0] == "--load":  # a converted directory: its hf/config.json and preprocessor_config.json
            (tmp_path / "hf").mkdir()
            (tmp_path / "hf" / "config.json").write_text(json.dumps(tiny_hf_config_dict(config)))
            (tmp_path / "hf" / "preprocessor_config.json").write_text(
                json.dumps({**HF_PREPROCESSOR, "size": {"height": 28, "width": 28}}))
        assert _data_check([shapes, "--seq-length", str(longest), *flags], capsys)[0] == 0, flags
        code, out, _ = _data_check([shapes, "--seq-length", str(longest - 1), *flags], capsys)
        assert code == 1 and f"{longest} tokens, longer than seq_length {longest - 1}" in out, flags


@pytest.mark.parametrize("flags, message", [
    (["--model", "internvl"], "--model internvl needs --load (a converted checkpoint), or internvl-tiny"),
    (["--model", "gpt"], "--model gpt takes no image data"),
    (["--model", "internvl-small"], "--model internvl-small: unknown"),
    (["--load", "LOAD", "--model", "qwen2_5_vl"], "holds a checkpoint of family internvl"),
    (["--load", "LOAD", "--model", "internvl-tiny"], "is a tiny preset"),
    (["--load", "EMPTY"], "config.json"),
])
def test_data_check_refuses_a_wrong_model_in_one_line(shapes, tmp_path, capsys, flags, message):
    from mm_adaptor.models.internvl import tiny_hf_config_dict

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(tiny_hf_config_dict()))
    flags = [str(tmp_path) if f == "LOAD" else str(tmp_path / "none") if f == "EMPTY" else f for f in flags]
    code, out, err = _data_check([shapes, "--seq-length", "64", *flags], capsys)
    assert code == 2 and not out and message in err and err.count("\n") == 1, err
