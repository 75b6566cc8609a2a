"""Qwen2.5-VL's 3-D rope index equals transformers' get_rope_index; the HF config reader round-trips."""

from types import SimpleNamespace

import pytest
import torch

from mm_adaptor.models.qwen2_5_vl import config_from_hf, rope_index_for, tiny_config, tiny_hf_config_dict

pytest.importorskip("transformers")

CONFIG = tiny_config()
START, END, IMAGE, VIDEO = CONFIG.vision_start_token_id, CONFIG.vision_start_token_id + 1, CONFIG.image_token_id, \
    CONFIG.video_token_id


def transformers_rope_index(*args, **kwargs):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    holder = SimpleNamespace(config=Qwen2_5_VLConfig(**tiny_hf_config_dict(CONFIG)))
    return Qwen2_5_VLModel.get_rope_index(holder, *args, **kwargs)


def text(n, seed):
    return torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def vision(token, grid):
    t, h, w = grid
    return [START] + [token] * (t * h * w // CONFIG.spatial_merge_size**2) + [END]


ONE_IMAGE = [[1, 4, 6]]
TWO_IMAGES = [[1, 10, 14], [1, 12, 8]]
CASES = {
    "text_only": dict(ids=[text(9, 0)]),
    "one_image": dict(ids=[text(3, 1) + vision(IMAGE, ONE_IMAGE[0]) + text(4, 2)], images=ONE_IMAGE),
    "two_images_of_different_sizes": dict(
        ids=[text(2, 3) + vision(IMAGE, TWO_IMAGES[0]) + text(3, 4) + vision(IMAGE, TWO_IMAGES[1]) + text(2, 5)],
        images=TWO_IMAGES),
    "video_grid": dict(ids=[text(2, 6) + vision(VIDEO, [3, 4, 4]) + text(3, 7)], videos=[[3, 4, 4]],
                       seconds=[2.0]),
    # transformers truncates fractional seconds per grid to an integer
    "video_fractional_seconds_and_image": dict(
        ids=[text(2, 8) + vision(IMAGE, ONE_IMAGE[0]) + text(1, 9) + vision(VIDEO, [2, 2, 4]) + text(2, 10)],
        images=ONE_IMAGE, videos=[[2, 2, 4]], seconds=[1.5]),
    "video_default_seconds": dict(ids=[vision(VIDEO, [2, 4, 2]) + text(3, 11)], videos=[[2, 4, 2]]),
}


def _tensors(case):
    grid = lambda key: torch.tensor(case[key]) if key in case else None  # noqa: E731
    seconds = torch.tensor(case["seconds"]) if "seconds" in case else None
    return torch.tensor(case["ids"]), grid("images"), grid("videos"), seconds


@pytest.mark.parametrize("name", list(CASES))
def test_rope_index_equals_transformers(name):
    ids, images, videos, seconds = _tensors(CASES[name])
    ours, our_deltas = rope_index_for(CONFIG, ids, images, videos, seconds)
    theirs, their_deltas = transformers_rope_index(ids, images, videos, seconds)
    assert torch.equal(ours, theirs), f"{ours}\n!=\n{theirs}"
    assert torch.equal(our_deltas.view(-1), their_deltas.view(-1))
    if images is not None or videos is not None:
        assert not torch.equal(ours[0], ours[1]), "vision tokens must get distinct height/width positions"


def test_rope_index_with_left_padding_equals_transformers():
    image_row = text(2, 12) + vision(IMAGE, ONE_IMAGE[0]) + text(3, 13)
    video_row = text(1, 14) + vision(VIDEO, [2, 2, 2]) + text(2, 15)
    text_row = text(5, 16)
    length = max(map(len, (image_row, video_row, text_row))) + 2
    rows = [image_row, video_row, text_row]
    ids = torch.tensor([[0] * (length - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows])
    args = (ids, torch.tensor(ONE_IMAGE), torch.tensor([[2, 2, 2]]), torch.tensor([1.0]), mask)
    ours, our_deltas = rope_index_for(CONFIG, *args)
    theirs, their_deltas = transformers_rope_index(*args)
    assert torch.equal(ours, theirs)
    assert torch.equal(our_deltas.view(-1), their_deltas.view(-1))
    # text only, padded: transformers' other branch (no grids)
    ours, our_deltas = rope_index_for(CONFIG, ids[2:], attention_mask=mask[2:])
    theirs, their_deltas = transformers_rope_index(ids[2:], attention_mask=mask[2:])
    assert torch.equal(ours, theirs) and torch.equal(our_deltas.view(-1), their_deltas.view(-1))


def test_config_from_hf_reads_both_layouts():
    from transformers import Qwen2_5_VLConfig

    nested = Qwen2_5_VLConfig(**tiny_hf_config_dict(CONFIG)).to_dict()
    assert config_from_hf(nested) == CONFIG
    flat = tiny_hf_config_dict(CONFIG)  # released config.json: text fields at the top level
    assert config_from_hf(flat) == CONFIG
    assert config_from_hf(flat, tensor_model_parallel_size=2).tensor_model_parallel_size == 2
    with pytest.raises(ValueError, match="mrope_section"):
        config_from_hf({**flat, "rope_scaling": None})
