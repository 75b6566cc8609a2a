"""The walk both Qwen families' 3-D rope indexes share: text advances the three axes together by one per token; a
vision block (the pad tokens right after a vision-start token) starts at the next free position p, and the text after
it one past the block's largest position. Each family says what a block's positions are (from 0)."""

from __future__ import annotations

from collections.abc import Callable

import torch

# (pad token id of the block, how many blocks of that kind came before it in the batch) -> [3, tokens] from 0
BlockPositions = Callable[[int, int], torch.Tensor]


def rope_index_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, vision_start_token_id: int,
                    vision_token_ids, block_positions: BlockPositions, dtype: torch.dtype):
    """position_ids [3, b, s] (padded slots: 1) and deltas [b, 1] (largest position + 1 - the padded length) for
    input_ids [b, s]; only tokens with attention_mask == 1 are counted."""
    batch, length = input_ids.shape
    position_ids = torch.ones(3, batch, length, dtype=dtype, device=input_ids.device)
    used = dict.fromkeys(vision_token_ids, 0)
    deltas = []
    for row in range(batch):
        keep = torch.ones(length, dtype=torch.bool) if attention_mask is None else attention_mask[row].cpu() == 1
        tokens = input_ids[row].cpu()[keep].tolist()
        chunks, next_pos, cursor = [], 0, 0
        for start in [i for i, token in enumerate(tokens[:-1]) if token == vision_start_token_id]:
            kind = tokens[start + 1]
            if kind not in used or start < cursor:
                continue
            block = block_positions(kind, used[kind])
            used[kind] += 1
            text_len = start + 1 - cursor
            chunks.append(text_positions(text_len, next_pos))
            block = block + next_pos + text_len
            chunks.append(block)
            next_pos = int(block.max()) + 1
            cursor = start + 1 + block.shape[1]
        if cursor < len(tokens):
            chunks.append(text_positions(len(tokens) - cursor, next_pos))
        positions = torch.cat(chunks, dim=1) if chunks else torch.zeros(3, 0, dtype=torch.long)
        position_ids[:, row, keep.to(position_ids.device)] = positions.to(position_ids)
        deltas.append(int(positions.max()) + 1 - length if positions.numel() else -length)
    return position_ids, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)


def grid_rows(grid_thw) -> list[tuple[int, int, int]]:
    return [] if grid_thw is None else [tuple(int(v) for v in row) for row in grid_thw]


def text_positions(count: int, first: int) -> torch.Tensor:
    return (torch.arange(count) + first).unsqueeze(0).expand(3, -1)
