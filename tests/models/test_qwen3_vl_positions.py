"""Qwen3-VL's 3-D rope index equals transformers 4.57's Qwen3VLModel.get_rope_index (a tiny model built from a
Qwen3VLConfig), on token layouts that transformers' own Qwen3VLProcessor writes (its __call__ run with a byte
tokenizer and stand-in image/video processors that only report grids: the real video processor needs torchvision)."""

import re

import pytest
import torch
from hf_compat import hf_takes_token_types

from mm_adaptor.data.images import frame_timestamps, video_placeholder
from mm_adaptor.models.qwen2_5_vl import rope_index as qwen2_5_rope_index
from mm_adaptor.models.qwen3_vl.positions import rope_index, rope_index_for

pytest.importorskip("transformers")

START, END, IMAGE, VIDEO = 300, 301, 302, 303
SPECIAL = {"<|vision_start|>": START, "<|vision_end|>": END, "<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO}
IMAGE_TAG, VIDEO_TAG = "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
PAD = 0


@pytest.fixture(scope="module")
def hf_model():
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    text = dict(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8,
                rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                  num_position_embeddings=16, deepstack_visual_indexes=[])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                           vision_start_token_id=START, vision_end_token_id=END)
    return Qwen3VLModel(config).eval()


class _Tokenizer:
    """Special tokens to their ids, any other text to its UTF-8 bytes; remembers the texts it was given."""
    init_kwargs = {}

    def __call__(self, texts, **kwargs):
        self.texts = list(texts)
        return {"input_ids": [[i for piece in re.split(r"(<\|[a-z_]+\|>)", text)
                               for i in ([SPECIAL[piece]] if piece in SPECIAL else list(piece.encode()))]
                              for text in texts]}


class _Grids:
    """A stand-in image or video processor: the grids (and video metadata) it was built with."""
    merge_size = 2

    def __init__(self, **outputs):
        self.outputs = outputs

    def __call__(self, **kwargs):
        return dict(self.outputs)


def processor_layout(texts, images=(), videos=()):
    """(token ids per text, texts as expanded, image grids, video grids) from Qwen3VLProcessor.__call__; videos:
    (grid_thw, fps, sampled frame indices) each."""
    if hf_takes_token_types():
        return expanded_layout(texts, images, videos)
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    processor = object.__new__(Qwen3VLProcessor)  # its __init__ wants real sub-processors
    processor.tokenizer = _Tokenizer()
    image_grid = torch.tensor([list(g) for g in images]) if images else None
    video_grid = torch.tensor([list(g) for g, _, _ in videos]) if videos else None
    processor.image_processor = _Grids(image_grid_thw=image_grid)
    processor.video_processor = _Grids(video_grid_thw=video_grid, video_metadata=[
        VideoMetadata(total_num_frames=max(i) + 1, fps=fps, frames_indices=list(i)) for _, fps, i in videos])
    for name, token in (("image", "<|image_pad|>"), ("video", "<|video_pad|>"), ("vision_start", "<|vision_start|>"),
                        ("vision_end", "<|vision_end|>")):
        setattr(processor, f"{name}_token", token)
        setattr(processor, f"{name}_token_id", SPECIAL[token])
    out = processor(text=texts, images=["image"] * len(images) or None, videos=["video"] * len(videos) or None)
    return out["input_ids"], processor.tokenizer.texts, image_grid, video_grid


def expanded_layout(texts, images=(), videos=()):
    """processor_layout written by our own data.images.video_placeholder, for transformers 5.x, whose processor
    cannot run on stand-in sub-processors (the 4.57 leg checks that the two layouts are the same)."""
    next_image, next_video, expanded = iter(images), iter(videos), []
    for text in texts:
        pieces = []
        for piece in re.split(f"({re.escape(IMAGE_TAG)}|{re.escape(VIDEO_TAG)})", text):
            if piece == IMAGE_TAG:
                t, h, w = next(next_image)
                piece = "<|vision_start|>" + "<|image_pad|>" * (t * h * w // 4) + "<|vision_end|>"
            elif piece == VIDEO_TAG:
                grid, fps, indices = next(next_video)
                piece = video_placeholder(frame_timestamps(indices, fps), grid[1] * grid[2] // 4)
            pieces.append(piece)
        expanded.append("".join(pieces))
    tokenizer = _Tokenizer()
    rows = tokenizer(expanded)["input_ids"]
    image_grid = torch.tensor([list(g) for g in images]) if images else None
    video_grid = torch.tensor([list(g) for g, _, _ in videos]) if videos else None
    return rows, tokenizer.texts, image_grid, video_grid


def test_our_layout_is_the_processors():
    """What expanded_layout writes is what transformers' processor writes (4.57: its processor runs on stand-ins)."""
    if hf_takes_token_types():
        pytest.skip("transformers 5.x's processor cannot run on stand-in sub-processors; the 4.57 leg compares")
    for case in CASES.values():
        args = (case["texts"], case.get("images", ()), case.get("videos", ()))
        assert processor_layout(*args)[:2] == expanded_layout(*args)[:2]


def left_padded(rows):
    length = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (length - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


VIDEO_A = ([3, 4, 6], 2.0, [0, 1, 2, 3, 4, 5])  # 6 frames at 2 fps: three temporal patches
VIDEO_ODD = ([3, 2, 4], 24.0, [0, 12, 24, 36, 48])  # 5 sampled frames: the last one doubles in the third patch
CASES = {
    "text_only": dict(texts=["plain text, no vision"]),
    "text_only_left_padded": dict(texts=["short", "a longer line of text"], padded=True),
    "one_image": dict(texts=[f"look {IMAGE_TAG} here"], images=[[1, 4, 6]]),
    "several_images": dict(texts=[f"a{IMAGE_TAG}b {IMAGE_TAG}{IMAGE_TAG} c"], images=[[1, 4, 6], [1, 8, 4], [1, 2, 2]]),
    "video": dict(texts=[f"watch {VIDEO_TAG} now"], videos=[VIDEO_A]),
    "video_odd_frame_count": dict(texts=[f"{VIDEO_TAG}what happens?"], videos=[VIDEO_ODD]),
    "image_and_videos": dict(texts=[f"x{IMAGE_TAG}y{VIDEO_TAG}z{IMAGE_TAG}{VIDEO_TAG}."],
                             images=[[1, 4, 4], [1, 2, 6]], videos=[VIDEO_A, VIDEO_ODD]),
    "batch_of_two_left_padded": dict(texts=[f"q {IMAGE_TAG} and {VIDEO_TAG} end", f"{IMAGE_TAG}?"],
                                     images=[[1, 4, 6], [1, 2, 2]], videos=[VIDEO_A], padded=True),
    "batch_row_without_vision": dict(texts=[f"{VIDEO_TAG} then text", "only text in this row"],
                                     videos=[VIDEO_ODD], padded=True),
}


def hf_rope_index(model, ids, images, videos, mask):
    """transformers' get_rope_index: 4.57 takes the grids; 5.x the token types first (1 image pad, 2 video pad)."""
    if hf_takes_token_types():
        types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
        return model.get_rope_index(ids, types, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask)
    return model.get_rope_index(ids, images, videos, mask)


@pytest.mark.parametrize("name", list(CASES))
def test_rope_index_equals_transformers(name, hf_model):
    case = CASES[name]
    rows, _, images, videos = processor_layout(case["texts"], case.get("images", ()), case.get("videos", ()))
    ids, mask = left_padded(rows)
    mask = mask if case.get("padded") else None
    theirs = hf_rope_index(hf_model, ids, images, videos, mask)
    ours = rope_index(ids, images, videos, mask, spatial_merge_size=2, image_token_id=IMAGE, video_token_id=VIDEO,
                      vision_start_token_id=START)
    assert ours[0].dtype == theirs[0].dtype and ours[0].shape == theirs[0].shape == (3, *ids.shape)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    assert torch.equal(ours[0][:, real], theirs[0][:, real]), name
    if hf_takes_token_types() and mask is not None:  # 5.x: padded slots 0 (4.57: 1), deltas over real tokens
        assert torch.equal(ours[1] + (~real).sum(1, keepdim=True), theirs[1].view(ours[1].shape)), name
    else:
        assert torch.equal(ours[0], theirs[0]), name
        assert torch.equal(ours[1], theirs[1].view(ours[1].shape)), name
    assert torch.equal(rope_index_for(hf_model.config, ids, images, videos, attention_mask=mask)[0], ours[0])
    if videos is not None:
        assert torch.equal(videos, torch.tensor([v[0] for v in case["videos"]]))  # the caller's grid is not split


def test_video_template_is_the_processors():
    """Per temporal patch: "<seconds with one decimal> seconds>" then a vision block of h*w/4 video pads; the seconds
    average the first and last sampled frame of the patch (0.25 s prints as 0.2: Python's round half to even)."""
    _, texts, _, _ = processor_layout([f"a {VIDEO_TAG} b"], videos=[VIDEO_A])
    block = "<|vision_start|>" + "<|video_pad|>" * 6 + "<|vision_end|>"
    assert texts == [f"a <0.2 seconds>{block}<1.2 seconds>{block}<2.2 seconds>{block} b"]
    assert frame_timestamps(VIDEO_A[2], VIDEO_A[1]) == [0.25, 1.25, 2.25]
    assert texts[0] == f"a {video_placeholder([0.25, 1.25, 2.25], 6)} b"
    _, texts, _, _ = processor_layout([VIDEO_TAG], videos=[VIDEO_ODD])
    assert texts == [video_placeholder(frame_timestamps(VIDEO_ODD[2], VIDEO_ODD[1]), 2)]
    assert texts[0].startswith("<0.2 seconds>") and "<1.2 seconds>" in texts[0] and "<2.0 seconds>" in texts[0]


def test_frame_blocks_restart_time_where_qwen2_5_vl_advances_it():
    """The negative check: for the same video grid (3 temporal patches of 2 s), Qwen2.5-VL's index over its layout
    (one vision block) moves the temporal axis on by 2 s * 2 tokens/s per patch; Qwen3-VL's keeps it at each frame
    block's start, the time being in the timestamps' text."""
    grid = torch.tensor([VIDEO_A[0]])
    ids25 = torch.tensor([[1, 2, START] + [VIDEO] * 18 + [END, 3]])
    pos25, _ = qwen2_5_rope_index(ids25, video_grid_thw=grid, second_per_grid_ts=[2.0], spatial_merge_size=2,
                                  image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                                  tokens_per_second=2)
    vision25 = pos25[:, 0, ids25[0] == VIDEO]
    assert sorted(set((vision25[0] - vision25[0].min()).tolist())) == [0, 4, 8]
    rows, _, _, videos = processor_layout([f"{VIDEO_TAG}"], videos=[VIDEO_A])
    ids = torch.tensor(rows)
    pos, _ = rope_index(ids, video_grid_thw=videos, spatial_merge_size=2, image_token_id=IMAGE,
                        video_token_id=VIDEO, vision_start_token_id=START)
    starts = (ids[0] == START).nonzero().flatten().tolist()
    for start in starts:  # each frame block: temporal = the block's first position, height/width from there
        block = pos[:, 0, start + 1:start + 7]
        assert set(block[0].tolist()) == {int(block[1].min())} == {int(block[2].min())}
    assert not torch.equal(pos[0, 0, ids[0] == VIDEO] - pos[0, 0, starts[0] + 1], vision25[0] - vision25[0].min())


def test_rope_index_for_our_config(hf_model):
    ours = pytest.importorskip("mm_adaptor.models.qwen3_vl.config")
    config = ours.Qwen3VLConfig(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START)
    case = CASES["batch_of_two_left_padded"]
    rows, _, images, videos = processor_layout(case["texts"], case["images"], case["videos"])
    ids, mask = left_padded(rows)
    ours_pos, _ = rope_index_for(config, ids, images, videos, attention_mask=mask)
    theirs_pos, _ = hf_rope_index(hf_model, ids, images, videos, mask)
    assert torch.equal(ours_pos, rope_index(ids, images, videos, mask, spatial_merge_size=2, image_token_id=IMAGE,
                                            video_token_id=VIDEO, vision_start_token_id=START)[0])
    assert torch.equal(ours_pos[:, mask.bool()], theirs_pos[:, mask.bool()])
