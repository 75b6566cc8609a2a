"""Qwen2.5-VL's 3-D (temporal, height, width) positions for mrope.

Text advances all three axes together by one per token. A vision block (the pad tokens after a vision-start token)
starts at the next free position p: its merged patch (frame f, row r, column c) gets (p + time(f), p + r, p + c),
time(f) = f * seconds_per_grid * tokens_per_second. The text after it starts one past the block's largest
position. Left (or any) padding: only tokens with attention_mask == 1 are counted; padded slots get position 1.
"""

from __future__ import annotations

import torch


def rope_index(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None = None,
               video_grid_thw: torch.Tensor | None = None, second_per_grid_ts=None,
               attention_mask: torch.Tensor | None = None, *, spatial_merge_size: int, image_token_id: int,
               video_token_id: int, vision_start_token_id: int, tokens_per_second: float):
    """position_ids [3, b, s] and mrope deltas [b, 1] (largest position + 1 - sequence length) for input_ids
    [b, s]; images and videos are taken from the grids in the order they appear, across the batch."""
    batch, length = input_ids.shape
    position_ids = torch.ones(3, batch, length, dtype=torch.long, device=input_ids.device)
    deltas = []
    grids = {image_token_id: _rows(image_grid_thw), video_token_id: _rows(video_grid_thw)}
    used = {image_token_id: 0, video_token_id: 0}
    for row in range(batch):
        keep = attention_mask[row] == 1 if attention_mask is not None else torch.ones(length, dtype=torch.bool)
        tokens = input_ids[row][keep.to(input_ids.device)].tolist()
        chunks, next_pos, cursor = [], 0, 0
        for start in [i for i, tok in enumerate(tokens) if tok == vision_start_token_id]:
            kind = tokens[start + 1] if start + 1 < len(tokens) else None
            if kind not in grids:
                continue
            index = used[kind]
            used[kind] += 1
            t, h, w = grids[kind][index]
            seconds = 0.0
            if kind == video_token_id:
                seconds = 1.0 if second_per_grid_ts is None else float(second_per_grid_ts[index])
            text_len = start + 1 - cursor
            chunks.append(_text_positions(text_len, next_pos))
            block = _vision_positions(t, h // spatial_merge_size, w // spatial_merge_size, seconds,
                                      tokens_per_second) + next_pos + text_len
            chunks.append(block)
            next_pos = int(block.max()) + 1
            cursor = start + 1 + block.shape[1]
        if cursor < len(tokens):
            chunks.append(_text_positions(len(tokens) - cursor, next_pos))
        positions = torch.cat(chunks, dim=1) if chunks else torch.zeros(3, 0, dtype=torch.long)
        position_ids[:, row, keep.to(position_ids.device)] = positions.to(position_ids.device)
        deltas.append(int(positions.max()) + 1 - length if positions.numel() else -length)
    return position_ids, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)


def rope_index_for(config, input_ids, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None,
                   attention_mask=None):
    """rope_index with the token ids and vision sizes of a Qwen25VLConfig."""
    return rope_index(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                      spatial_merge_size=config.spatial_merge_size, image_token_id=config.image_token_id,
                      video_token_id=config.video_token_id, vision_start_token_id=config.vision_start_token_id,
                      tokens_per_second=config.tokens_per_second)


def _rows(grid_thw):
    return [] if grid_thw is None else [tuple(int(v) for v in row) for row in grid_thw]


def _text_positions(count: int, first: int) -> torch.Tensor:
    return (torch.arange(count) + first).unsqueeze(0).expand(3, -1)


def _vision_positions(frames: int, rows: int, cols: int, seconds_per_grid: float, tokens_per_second: float):
    # transformers casts seconds_per_grid to an integer (truncation) before scaling; done here too, so that the
    # positions equal its own
    step = int(seconds_per_grid)
    time = (torch.arange(frames) * step * tokens_per_second).long()
    time = time.repeat_interleave(rows * cols)
    height = torch.arange(rows).repeat_interleave(cols).repeat(frames)
    width = torch.arange(cols).repeat(rows * frames)
    return torch.stack([time, height, width])
