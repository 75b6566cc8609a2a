"""Qwen3-VL's 3-D (temporal, height, width) positions for its interleaved mrope (transformers 4.57's
Qwen3VLModel.get_rope_index defines the result; the interleaving of the three axes over the rotary frequencies is
the rotary embedding's business, not the index's).

Text advances all three axes together by one per token. A vision block (the pad tokens right after a vision-start
token) starts at the next free position p: its merged patch (frame f, row r, column c) gets (p + f, p + r, p + c),
and the text after it starts one past the block's largest position. Unlike Qwen2.5-VL there is no absolute time:
the processor splits a video of grid_t temporal patches into grid_t one-frame blocks, each after a text timestamp
("<0.2 seconds><|vision_start|><|video_pad|>...<|vision_end|>" per temporal patch), so every video row [t, h, w] of
video_grid_thw stands for t blocks of [1, h, w] and a block's temporal position is always p.

Padding (left or any): only tokens with attention_mask == 1 are counted; padded slots get position 1, and the
delta of a row is its largest position + 1 - the padded length. Text only (no grids at all): positions are the
running count of real tokens (0, 1, ... without a mask).

transformers 5.x (checked on 5.24) computes the same positions for real tokens but puts 0 in padded slots and
measures the delta against the count of real tokens; 4.57, which this repository pins, is followed here.
"""

from __future__ import annotations

import torch

from mm_adaptor.models.mrope_index import grid_rows, rope_index_rows


def rope_index(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None = None,
               video_grid_thw: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, *,
               spatial_merge_size: int, image_token_id: int, video_token_id: int, vision_start_token_id: int):
    """position_ids [3, b, s] (input_ids' dtype) and mrope deltas [b, 1] for input_ids [b, s]; images and video
    frames are taken from the grids in the order they appear, across the batch."""
    if image_grid_thw is None and video_grid_thw is None:
        return _text_only(input_ids, attention_mask)
    grids = {image_token_id: grid_rows(image_grid_thw), video_token_id: _frame_rows(video_grid_thw)}

    def block_positions(kind: int, index: int) -> torch.Tensor:
        t, h, w = grids[kind][index]
        return _vision_positions(t, h // spatial_merge_size, w // spatial_merge_size)

    return rope_index_rows(input_ids, attention_mask, vision_start_token_id=vision_start_token_id,
                           vision_token_ids=grids, block_positions=block_positions, dtype=input_ids.dtype)


def rope_index_for(config, input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
    """rope_index with the token ids and merge size of a Qwen3-VL config (ours, or any object with these fields;
    transformers' Qwen3VLConfig keeps the merge size in vision_config)."""
    merge = getattr(config, "spatial_merge_size", None)
    if merge is None:
        merge = config.vision_config.spatial_merge_size
    return rope_index(input_ids, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size=merge,
                      image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                      vision_start_token_id=config.vision_start_token_id)


def _text_only(input_ids, attention_mask):
    batch, length = input_ids.shape
    if attention_mask is None:
        positions = torch.arange(length, device=input_ids.device).expand(3, batch, length)
        return positions, torch.zeros(batch, 1, dtype=input_ids.dtype, device=input_ids.device)
    real = attention_mask == 1
    count = real.long().cumsum(-1) - 1
    count = torch.where(real, count, torch.ones_like(count))
    deltas = count.max(-1, keepdim=True).values + 1 - length
    return count.unsqueeze(0).expand(3, -1, -1), deltas



def _frame_rows(video_grid_thw):
    # a video of t temporal patches is t one-frame blocks, each behind its own timestamp
    return [(1, h, w) for t, h, w in grid_rows(video_grid_thw) for _ in range(t)]



def _vision_positions(frames: int, rows: int, cols: int) -> torch.Tensor:
    time = torch.arange(frames).repeat_interleave(rows * cols)
    height = torch.arange(rows).repeat_interleave(cols).repeat(frames)
    width = torch.arange(cols).repeat(rows * frames)
    return torch.stack([time, height, width])
