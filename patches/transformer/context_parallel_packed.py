"""Context parallelism for packed sequences (--packing, megatron's THD layout) on any backend.

Each segment of a pack (a sample, or the padding) is a multiple of 2 x CP long and is split as a sequence of its own:
CP rank r holds chunks r and 2 x CP - 1 - r of every segment, segment after segment (core.sequence_split
.local_segments; megatron's THD rope reads that layout). The attention masks by token: a query sees a key of its own
segment at the same or an earlier position. Every rank knows the pack's segment lengths, so it knows which tokens
every other rank holds: nothing but keys and values travels.

- Ulysses: the all-to-all gathers the group's tokens in rank order (no reordering: the mask goes by token).
- Ring: keys and values travel around the group as in the unpacked ring; each step is one block, skipped when no
  query of this rank sees a key of the block; backward passes the gradients home beside them.
- Hybrid: Ulysses inside groups of consecutive CP ranks, the ring across the groups.

Blocks are computed in fp32 by query rows (context_parallel_blocks.block_forward with a per-token mask): no
[s, s] tensor."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mm_adaptor.core.sequence_split import local_tokens
from mm_adaptor.patches.transformer.context_parallel_blocks import (
    _AllToAll,
    _merge,
    _pass_on,
    block_backward,
    block_forward,
)


def _hidden(q_tokens, k_tokens, cross_segments: bool):
    """masked(start, rows) for block_forward: True where a query row does not see a key."""
    q_segment, q_position = q_tokens
    k_segment, k_position = k_tokens

    def masked(start, rows):
        visible = k_position[None, :] <= q_position[start:start + rows, None]
        if not cross_segments:
            visible &= k_segment[None, :] == q_segment[start:start + rows, None]
        return ~visible

    return masked


def _sees(q_tokens, k_tokens, cross_segments: bool) -> bool:
    """Whether any query sees any key: per segment, the earliest key position against the latest query position."""
    if cross_segments:
        return True
    (q_segment, q_position), (k_segment, k_position) = q_tokens, k_tokens
    count = int(max(q_segment.max(), k_segment.max())) + 1
    latest = torch.full((count,), -1, dtype=torch.long, device=q_segment.device)
    latest = latest.scatter_reduce(0, q_segment, q_position, "amax")
    earliest = torch.full((count,), 1 << 62, dtype=torch.long, device=k_segment.device)
    earliest = earliest.scatter_reduce(0, k_segment, k_position, "amin")
    return bool((earliest <= latest).any())


class PackedRing(torch.autograd.Function):
    """q [s, 1, h, d], k and v [s, 1, hk, d]: the tokens of ring member `rank`; tokens[j]: (segment, position) of
    the tokens ring member j holds. One ring member (group None): plain masked attention."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale: float, tokens: list, cross_segments: bool = False):
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[1], q.shape[2], q.shape[0]), float("-inf"), device=q.device)
        kv = (k, v)
        for step in range(size):
            source = (rank - step) % size
            if _sees(tokens[rank], tokens[source], cross_segments):
                masked = _hidden(tokens[rank], tokens[source], cross_segments)
                out, lse = _merge(out, lse, *block_forward(q, kv[0], kv[1], scale, False, masked))
            if step + 1 < size:
                kv = tuple(_pass_on(kv, group))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.tokens, ctx.cross = group, scale, tokens, cross_segments
        ctx.size, ctx.rank = size, rank
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        size, rank, tokens, cross = ctx.size, ctx.rank, ctx.tokens, ctx.cross
        delta = (dout.float() * out).sum(-1).permute(1, 2, 0)  # [b, h, s]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = (k, v)
        dkv = (torch.zeros(k.shape, dtype=torch.float32, device=q.device),
               torch.zeros(v.shape, dtype=torch.float32, device=q.device))
        for step in range(size):
            source = (rank - step) % size
            if _sees(tokens[rank], tokens[source], cross):
                masked = _hidden(tokens[rank], tokens[source], cross)
                dq_block, dk, dv = block_backward(q, kv[0], kv[1], dout, lse, delta, ctx.scale, False, masked)
                dq += dq_block
                dkv = (dkv[0] + dk, dkv[1] + dv)
            if step + 1 < size:
                *kv, dk_all, dv_all = _pass_on((*kv, *dkv), ctx.group)
                kv, dkv = tuple(kv), (dk_all, dv_all)
        if size > 1:  # one more hop brings each key/value gradient home
            dkv = tuple(_pass_on(dkv, ctx.group))
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _gather_sequence(x, group, head_order=None):
    """[s, b, h, d] -> [size x s, b, h / size, d]: the group's tokens in rank order, this rank's share of heads."""
    size = dist.get_world_size(group)
    s, b, h, d = x.shape
    parts = x.view(s, b, size, h // size, d)
    if head_order is not None:
        parts = parts[:, :, head_order]
    return _AllToAll.apply(parts.permute(2, 0, 1, 3, 4), group).reshape(size * s, b, h // size, d)


def _scatter_sequence(x, group):
    size = dist.get_world_size(group)
    s_all, b, hs, d = x.shape
    back = _AllToAll.apply(x.view(size, s_all // size, b, hs, d), group)  # [size (head group), s, b, hs, d]
    return back.permute(1, 2, 0, 3, 4).reshape(s_all // size, b, hs * size, d)


def packed_attention(q, k, v, ulysses_group, ring_group, scale: float, segments: list[int], cp_size: int,
                     cross_segments: bool = False, head_order=None):
    """Causal attention within the segments of a pack split over the CP group: q, k, v and the result are this CP
    rank's [s_local, 1, heads, d]. Ring member j holds the tokens of CP ranks j x U .. j x U + U - 1 (U: the
    Ulysses degree). cross_segments and head_order: only for the broken variants."""
    u = dist.get_world_size(ulysses_group) if ulysses_group is not None else 1
    ring = ring_group if ring_group is not None and dist.get_world_size(ring_group) > 1 else None

    def held_by(member):
        parts = [local_tokens(segments, r, cp_size, q.device) for r in range(member * u, (member + 1) * u)]
        return tuple(torch.cat(field) for field in zip(*parts))

    tokens = [held_by(j) for j in range(cp_size // u)]

    def attend(*qkv):
        return PackedRing.apply(*qkv, ring, scale, tokens, cross_segments)

    if u == 1:
        return attend(q, k, v)
    gathered = [_gather_sequence(x, ulysses_group, head_order) for x in (q, k, v)]
    return _scatter_sequence(attend(*gathered), ulysses_group)
