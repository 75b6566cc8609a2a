"""Qwen2.5-VL's 3-D rope index equals transformers' get_rope_index; the HF config reader round-trips."""

from types import MethodType, SimpleNamespace

import pytest
import torch

from mm_adaptor.models.qwen2_5_vl import config_from_hf, rope_index_for, tiny_config, tiny_hf_config_dict

pytest.importorskip("transformers")

CONFIG = tiny_config()
START, END, IMAGE, VIDEO = CONFIG.vision_start_token_id, CONFIG.vision_start_token_id + 1, CONFIG.image_token_id, \
    CONFIG.video_token_id


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def transformers_rope_index(input_ids, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None,
                            attention_mask=None):
    """transformers' get_rope_index on the tiny config: 4.x finds the vision blocks from the token ids, 5.x from
    `mm_token_type_ids` (1 image pad, 2 video pad) and calls the model's get_vision_position_ids."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    holder = SimpleNamespace(config=Qwen2_5_VLConfig(**tiny_hf_config_dict(CONFIG)))
    if transformers_major() < 5:
        return Qwen2_5_VLModel.get_rope_index(holder, input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts,
                                              attention_mask)
    holder.get_vision_position_ids = MethodType(Qwen2_5_VLModel.get_vision_position_ids, holder)
    types = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
    return Qwen2_5_VLModel.get_rope_index(holder, input_ids, types, image_grid_thw, video_grid_thw,
                                          second_per_grid_ts, attention_mask)


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
    # transformers 4.57 truncates fractional seconds per grid to an integer (5.x does not)
    "video_fractional_seconds_and_image": dict(
        ids=[text(2, 8) + vision(IMAGE, ONE_IMAGE[0]) + text(1, 9) + vision(VIDEO, [2, 2, 4]) + text(2, 10)],
        images=ONE_IMAGE, videos=[[2, 2, 4]], seconds=[1.5]),
    "video_default_seconds": dict(ids=[vision(VIDEO, [2, 4, 2]) + text(3, 11)], videos=[[2, 4, 2]]),
}


# transformers 5 changed get_rope_index (5.24.0): the text after a video starts at the video's first position plus
# its larger side in merged patches (4.57: one past the block's largest position, time included), fractional seconds
# per grid are no longer truncated, padded slots get 0 (4.57: 1) and the deltas count unpadded tokens. Ours keep
# 4.57's rule. Where the two differ, the positions each version gave are recorded here ([3, b, s] or the one row
# [3, s], and the deltas): ours must equal 4.57's, which the 4.57 leg also compares live, and the installed
# transformers must give its own (so that a transformers that changes them again shows here).
RECORDED = {
    4: {
        "video_grid": ([[0, 1, 2, 3, 3, 3, 3, 7, 7, 7, 7, 11, 11, 11, 11, 12, 13, 14, 15],
                        [0, 1, 2, 3, 3, 4, 4, 3, 3, 4, 4, 3, 3, 4, 4, 12, 13, 14, 15],
                        [0, 1, 2, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 12, 13, 14, 15]], [-3]),
        "video_fractional_seconds_and_image": ([[0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8, 9, 9, 11, 11, 12, 13, 14],
                                                [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8, 9, 9, 9, 9, 12, 13, 14],
                                                [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10, 9, 10, 12, 13, 14]], [-4]),
        "video_default_seconds": ([[0, 1, 1, 3, 3, 4, 5, 6, 7],
                                   [0, 1, 2, 1, 2, 4, 5, 6, 7],
                                   [0, 1, 1, 1, 1, 4, 5, 6, 7]], [-1]),
        "left_padding": ([[[1, 1, 0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8, 9],
                           [1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 2, 4, 5, 6, 7],
                           [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 2, 3, 4]],
                          [[1, 1, 0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8, 9],
                           [1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 2, 2, 5, 6, 7],
                           [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 2, 3, 4]],
                          [[1, 1, 0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9],
                           [1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 2, 2, 5, 6, 7],
                           [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 2, 3, 4]]], [-5, -7, -10]),
        "left_padding_text": ([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 2, 3, 4],
                               [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 2, 3, 4],
                               [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 2, 3, 4]], [-10]),
    },
    5: {
        "video_grid": ([[0, 1, 2, 3, 3, 3, 3, 7, 7, 7, 7, 11, 11, 11, 11, 5, 6, 7, 8],
                        [0, 1, 2, 3, 3, 4, 4, 3, 3, 4, 4, 3, 3, 4, 4, 5, 6, 7, 8],
                        [0, 1, 2, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 5, 6, 7, 8]], [-7]),
        "video_fractional_seconds_and_image": ([[0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8, 9, 9, 12, 12, 11, 12, 13],
                                                [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8, 9, 9, 9, 9, 11, 12, 13],
                                                [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10, 9, 10, 11, 12, 13]], [-5]),
        "video_default_seconds": ([[0, 1, 1, 3, 3, 3, 4, 5, 6],
                                   [0, 1, 2, 1, 2, 3, 4, 5, 6],
                                   [0, 1, 1, 1, 1, 3, 4, 5, 6]], [-2]),
        "left_padding": ([[[0, 0, 0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8, 9],
                           [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 4, 3, 4, 5],
                           [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]],
                          [[0, 0, 0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8, 9],
                           [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 2, 3, 4, 5],
                           [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]],
                          [[0, 0, 0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9],
                           [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 2, 3, 4, 5],
                           [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]]], [-3, -1, 0]),
        "left_padding_text": ([[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4],
                               [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4],
                               [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]], [0]),
    },
}


def _tensors(case):
    grid = lambda key: torch.tensor(case[key]) if key in case else None  # noqa: E731
    seconds = torch.tensor(case["seconds"]) if "seconds" in case else None
    return torch.tensor(case["ids"]), grid("images"), grid("videos"), seconds


def _as_recorded(positions, deltas) -> tuple:
    return positions[:, 0].tolist() if positions.shape[1] == 1 else positions.tolist(), deltas.view(-1).tolist()


def _check(name, ours, theirs):
    """ours == transformers' live, or for a recorded case: ours == 4.57's record, transformers' == its version's."""
    if name in RECORDED[4]:
        assert _as_recorded(*ours) == RECORDED[4][name]
        assert _as_recorded(*theirs) == RECORDED[min(transformers_major(), 5)][name]
        return
    assert torch.equal(ours[0], theirs[0]), f"{ours[0]}\n!=\n{theirs[0]}"
    assert torch.equal(ours[1].view(-1), theirs[1].view(-1))


@pytest.mark.parametrize("name", list(CASES))
def test_rope_index_equals_transformers(name):
    ids, images, videos, seconds = _tensors(CASES[name])
    ours = rope_index_for(CONFIG, ids, images, videos, seconds)
    _check(name, ours, transformers_rope_index(ids, images, videos, seconds))
    if images is not None or videos is not None:
        assert not torch.equal(ours[0][0], ours[0][1]), "vision tokens must get distinct height/width positions"


def test_rope_index_with_left_padding_equals_transformers():
    image_row = text(2, 12) + vision(IMAGE, ONE_IMAGE[0]) + text(3, 13)
    video_row = text(1, 14) + vision(VIDEO, [2, 2, 2]) + text(2, 15)
    text_row = text(5, 16)
    length = max(map(len, (image_row, video_row, text_row))) + 2
    rows = [image_row, video_row, text_row]
    ids = torch.tensor([[0] * (length - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows])
    args = (ids, torch.tensor(ONE_IMAGE), torch.tensor([[2, 2, 2]]), torch.tensor([1.0]), mask)
    _check("left_padding", rope_index_for(CONFIG, *args), transformers_rope_index(*args))
    # text only, padded: transformers' other branch (no grids)
    _check("left_padding_text", rope_index_for(CONFIG, ids[2:], attention_mask=mask[2:]),
           transformers_rope_index(ids[2:], attention_mask=mask[2:]))


def test_config_from_hf_reads_both_layouts():
    from transformers import Qwen2_5_VLConfig

    nested = Qwen2_5_VLConfig(**tiny_hf_config_dict(CONFIG)).to_dict()
    assert config_from_hf(nested) == CONFIG
    flat = tiny_hf_config_dict(CONFIG)  # released config.json: text fields at the top level
    assert config_from_hf(flat) == CONFIG
    assert config_from_hf(flat, tensor_model_parallel_size=2).tensor_model_parallel_size == 2
    with pytest.raises(ValueError, match="mrope_section"):
        config_from_hf({**flat, "rope_scaling": None})
