"""Megatron's load-balanced split of a sequence over the context-parallel (CP) group (its get_batch_on_this_cp_rank):
2 x CP chunks, CP rank r holds chunks r and 2 x CP - 1 - r, one after the other, so that every rank has the same
causal attention work. The driver splits batches with it, the vision-language models their embeddings, and the CP
attention (patches/transformer/context_parallel.py) reads the layout."""

from __future__ import annotations


def chunks_of(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp_size) a CP rank holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_half(x, cp_rank: int, cp_size: int, dim: int = 0):
    """This CP rank's part of a whole sequence (a tensor, along dim): its two chunks, concatenated."""
    import torch

    parts = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([parts[c] for c in chunks_of(cp_rank, cp_size)], dim=dim)
