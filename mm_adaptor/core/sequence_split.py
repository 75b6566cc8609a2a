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


# --- packed sequences (THD): each segment is split as a sequence of its own -----------------------------------------

def padded_length(length: int, cp_size: int) -> int:
    """A segment's length rounded up to a multiple of 2 x cp_size, so that it splits into equal chunks."""
    unit = 2 * cp_size
    return -(-length // unit) * unit


def local_segments(x, cp_rank: int, cp_size: int, segments: list[int], dim: int = 0):
    """This CP rank's part of a packed sequence (segment lengths `segments`, each a multiple of 2 x cp_size): of
    every segment its two chunks, segment after segment (megatron's THD layout, as its rope reads it)."""
    import torch

    parts = x.split(segments, dim=dim)
    return torch.cat([local_half(part, cp_rank, cp_size, dim=dim) for part in parts], dim=dim)


def local_tokens(segments: list[int], cp_rank: int, cp_size: int, device=None):
    """(segment index, position in the segment) of each token this CP rank holds of a packed sequence: what the
    packed context-parallel attention masks by."""
    import torch

    index = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(segments)])
    position = torch.cat([torch.arange(n) for n in segments])
    return tuple(local_segments(t, cp_rank, cp_size, segments).to(device) for t in (index, position))


def segment_lengths(cu_seqlens) -> list[int]:
    """Segment lengths of cumulative bounds (a tensor or a list)."""
    cu = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
    return [b - a for a, b in zip(cu, cu[1:])]


def context_parallel_part(x, cp_rank: int, cp_size: int, packed_seq_params=None, dim: int = 0):
    """This CP rank's part of a whole sequence: its two chunks, or of a pack (megatron's PackedSeqParams with
    cu_seqlens_q_padded) its two chunks of every segment."""
    if packed_seq_params is None:
        return local_half(x, cp_rank, cp_size, dim=dim)
    return local_segments(x, cp_rank, cp_size, segment_lengths(packed_seq_params.cu_seqlens_q_padded), dim=dim)
