"""Batches: token layout, shifted labels and loss mask, 3-D positions, DP-independent sharding, resume."""

import json

import pytest
import torch

from mm_adaptor.data import build, images, validate
from mm_adaptor.data.vlm import IGNORE_INDEX, global_batch_indices
from mm_adaptor.models.qwen2_5_vl import rope_index_for

SEQ = 320


def test_layout_labels_and_mask(shapes, byte_setup):
    tokenizer, config = byte_setup
    batch = next(build(shapes, tokenizer, config, SEQ, micro_batch_size=4, global_batch_size=4))
    records = json.load(open(shapes))
    ids_of = tokenizer.special_ids
    assert batch["input_ids"].shape == (4, SEQ) and batch["position_ids"].shape == (3, 4, SEQ)
    patches_seen = 0
    for row in range(4):
        record = records[int(batch["sample_index"][row])]
        real = batch["attention_mask"][row]
        n = int(real.sum())
        assert int(batch["num_tokens"][row]) == n and bool(real[:n].all()) and not bool(real[n:].any())
        text = tokenizer.decode(batch["input_ids"][row, :n])
        grid = batch["image_grid_thw"][row].tolist()
        pads = "<|image_pad|>" * (grid[0] * grid[1] * grid[2] // 4)
        question = record["messages"][0]["content"].replace("<image>", "<|vision_start|>" + pads + "<|vision_end|>")
        answer = record["messages"][1]["content"]
        assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                        f"{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n")
        # labels are shifted by the data: labels[t] = input_ids[t+1] on targets, the answer and its <|im_end|>
        mask = batch["loss_mask"][row].bool()
        assert torch.equal(mask, batch["labels"][row] != IGNORE_INDEX)
        targets = batch["labels"][row][mask]
        assert torch.equal(targets, batch["input_ids"][row, 1:][mask[:-1]])
        assert tokenizer.decode(targets) == answer + "<|im_end|>"
        assert bool((batch["input_ids"][row, n:] == ids_of["<|endoftext|>"]).all())
        # positions of the real tokens are those of the unpadded sample
        alone, _ = rope_index_for(config, batch["input_ids"][row:row + 1, :n], batch["image_grid_thw"][row:row + 1])
        assert torch.equal(batch["position_ids"][:, row, :n], alone[:, 0])
        patches_seen += grid[0] * grid[1] * grid[2]
    assert batch["pixel_values"].shape == (patches_seen, 1176) and batch["pixel_values"].dtype == torch.float32
    assert int((batch["input_ids"] == config.image_token_id).sum()) * 4 == patches_seen


def _global_batches(shapes, byte_setup, dp_size, iterations, start=0, gbs=8, mbs=2):
    tokenizer, config = byte_setup
    ranks = [build(shapes, tokenizer, config, SEQ, mbs, gbs, dp_rank=r, dp_size=dp_size, start_iteration=start,
                   seed=7) for r in range(dp_size)]
    out = []
    for _ in range(iterations):
        parts = [next(it) for it in ranks for _ in range(ranks[0].num_microbatches)]
        out.append({key: torch.cat([p[key] for p in parts]) for key in ("input_ids", "labels", "sample_index")}
                   | {"pixel_values": torch.cat([p["pixel_values"] for p in parts])})
    return out


def test_global_batch_independent_of_dp_and_resumable(shapes, byte_setup):
    one = _global_batches(shapes, byte_setup, 1, 3)  # 3 x 8 samples of 16: crosses an epoch
    two = _global_batches(shapes, byte_setup, 2, 3)
    for a, b in zip(one, two):
        for key in a:
            assert torch.equal(a[key], b[key]), key
    assert sorted(torch.cat([one[0]["sample_index"], one[1]["sample_index"]]).tolist()) == list(range(16))
    assert one[0]["sample_index"].tolist() != list(range(8))  # shuffled
    resumed = _global_batches(shapes, byte_setup, 2, 1, start=2)
    assert torch.equal(resumed[0]["input_ids"], one[2]["input_ids"])


def test_epochs_are_different_permutations():
    first, second = global_batch_indices(0, 10, 10, seed=1), global_batch_indices(1, 10, 10, seed=1)
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    assert global_batch_indices(0, 10, 10, seed=2) != first


def test_pixel_bounds_change_the_grid(shapes, byte_setup):
    tokenizer, config = byte_setup
    small = validate(shapes, tokenizer, SEQ, image_min_pixels=28 * 28, image_max_pixels=28 * 28 * 4)
    assert all(images.image_tokens(g) <= 4 for s in small.samples for g in s.grids)
    batch = next(build(shapes, tokenizer, config, SEQ, 2, 2, image_min_pixels=28 * 28, image_max_pixels=28 * 28 * 4))
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(1).sum()) <= 2 * 16


def test_refuses_bad_batch_sizes_and_wrong_model_ids(shapes, byte_setup):
    from mm_adaptor.data import DataError
    from mm_adaptor.models.qwen2_5_vl import tiny_config

    tokenizer, config = byte_setup
    with pytest.raises(DataError, match="multiple"):
        build(shapes, tokenizer, config, SEQ, micro_batch_size=3, global_batch_size=8, dp_size=2)
    with pytest.raises(DataError, match="image_token_id"):
        build(shapes, tokenizer, tiny_config(image_token_id=499), SEQ)


def test_a_later_pipeline_stage_opens_no_image(shapes, byte_setup, monkeypatch):
    """Pipeline stages after the first take no pixels: their batches open no image, and are the first stage's
    otherwise."""
    from PIL import Image

    tokenizer, config = byte_setup
    first = next(build(shapes, tokenizer, config, SEQ, micro_batch_size=4, global_batch_size=4))
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("an image was opened"))
    later = next(build(shapes, tokenizer, config, SEQ, micro_batch_size=4, global_batch_size=4, decode_pixels=False))
    assert first["pixel_values"] is not None and later["pixel_values"] is None
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "image_grid_thw"):
        assert torch.equal(first[name], later[name]), name


def test_each_familys_default_system_turn():
    """Qwen2.5-VL's template adds its default system prompt to messages without one; Qwen3-VL's writes a system turn
    only for a system message (its tokenizer's identity, hence a data index's key, says which)."""
    from mm_adaptor.data import load_tokenizer
    from mm_adaptor.data.records import Record
    from mm_adaptor.data.template import encode
    from mm_adaptor.models import qwen2_5_vl, qwen3_vl

    user = {"role": "user", "content": "Hi"}
    texts = {}
    for name, package in (("qwen2_5_vl", qwen2_5_vl), ("qwen3_vl", qwen3_vl)):
        tokenizer = load_tokenizer(None, package.tiny_config())
        for system in (None, "Be brief."):
            messages = ([{"role": "system", "content": system}] if system else []) + [user]
            texts[name, system] = tokenizer.decode(encode(Record("f", "line 1", messages), [], tokenizer)[0])
    assert texts["qwen2_5_vl", None].startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert texts["qwen3_vl", None] == "<|im_start|>user\nHi<|im_end|>\n"
    for name in ("qwen2_5_vl", "qwen3_vl"):
        assert texts[name, "Be brief."] == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert load_tokenizer(None, qwen3_vl.tiny_config()).identity() != load_tokenizer(None).identity()
