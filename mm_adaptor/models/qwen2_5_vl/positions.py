"""Qwen2.5-VL's 3-D (temporal, height, width) positions for mrope.

Text advances all three axes together by one per token. A vision block (the pad tokens after a vision-start token)
starts at the next free position p: its merged patch (frame f, row r, column c) gets (p + time(f), p + r, p + c),
time(f) = f * seconds_per_grid * tokens_per_second. The text after it starts one past the block's largest
position. Left (or any) padding: only tokens with attention_mask == 1 are counted; padded slots get position 1.
"""

from __future__ import annotations

import torch

from mm_adaptor.models.mrope_index import grid_rows, rope_index_rows


def rope_index(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None = None,
               video_grid_thw: torch.Tensor | None = None, second_per_grid_ts=None,
               attention_mask: torch.Tensor | None = None, *, spatial_merge_size: int, image_token_id: int,
               video_token_id: int, vision_start_token_id: int, tokens_per_second: float):
    """position_ids [3, b, s] and mrope deltas [b, 1] (largest position + 1 - sequence length) for input_ids
    [b, s]; images and videos are taken from the grids in the order they appear, across the batch."""
    grids = {image_token_id: grid_rows(image_grid_thw), video_token_id: grid_rows(video_grid_thw)}

    def block_positions(kind: int, index: int) -> torch.Tensor:
        t, h, w = grids[kind][index]
        seconds = 0.0
        if kind == video_token_id:
            seconds = 1.0 if second_per_grid_ts is None else float(second_per_grid_ts[index])
        return _vision_positions(t, h // spatial_merge_size, w // spatial_merge_size, seconds, tokens_per_second)

    return rope_index_rows(input_ids, attention_mask, vision_start_token_id=vision_start_token_id,
                           vision_token_ids=grids, block_positions=block_positions, dtype=torch.long)


def rope_index_for(config, input_ids, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None,
                   attention_mask=None):
    """rope_index with the token ids and vision sizes of a Qwen25VLConfig."""
    return rope_index(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                      spatial_merge_size=config.spatial_merge_size, image_token_id=config.image_token_id,
                      video_token_id=config.video_token_id, vision_start_token_id=config.vision_start_token_id,
                      tokens_per_second=config.tokens_per_second)



def _vision_positions(frames: int, rows: int, cols: int, seconds_per_grid: float, tokens_per_second: float):
    # transformers casts seconds_per_grid to an integer (truncation) before scaling; done here too, so that the
    # positions equal its own
    step = int(seconds_per_grid)
    time = (torch.arange(frames) * step * tokens_per_second).long()
    time = time.repeat_interleave(rows * cols)
    height = torch.arange(rows).repeat_interleave(cols).repeat(frames)
    width = torch.arange(cols).repeat(rows * frames)
    return torch.stack([time, height, width])
