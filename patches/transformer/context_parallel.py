"""Causal self-attention over a sequence split across the context-parallel (CP) group, on any backend.

The split is megatron's load-balanced one (get_batch_on_this_cp_rank): the sequence is cut into 2 x CP chunks and
CP rank r holds chunks r and 2 x CP - 1 - r, one after the other, so every rank has the same causal work.

- Ulysses (ulysses_cp_algo): an all-to-all turns [this rank's tokens, all heads] into [all tokens, heads / CP],
  attention runs on whole sequences, and a second all-to-all turns it back. Heads and KV heads must divide by CP.
- Ring (megatron_cp_algo): the keys and values travel around the group; each rank merges its blocks' results by
  their log-sum-exp. No rank ever holds more than two chunks' keys and values; backward passes them around again,
  with their gradients travelling beside them back to their owner.
- Hybrid (hybrid_cp_algo): Ulysses inside groups of consecutive CP ranks, the ring across those groups. After the
  Ulysses all-to-all a group holds two contiguous runs of chunks, which is the ring's load-balanced layout again.

Tensors are megatron's [s, b, heads, head dim]. Blocks are computed in fp32 by query rows (context_parallel_blocks),
so no [s, s] tensor is made. Packs (--packing, THD) take context_parallel_packed.py's path."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mm_adaptor.core.sequence_split import chunks_of, segment_lengths
from mm_adaptor.patches.transformer.context_parallel_blocks import (
    _AllToAll,
    _merge,
    _pass_on,
    block_backward,
    block_forward,
)

# --- the ring -----------------------------------------------------------------------------------------------------

def _pairs(q_chunks, kv_chunks):
    """(q part, kv part, causal) for each block that has visible keys: earlier chunk fully, the same chunk causally."""
    for qi, qc in enumerate(q_chunks):
        for ki, kc in enumerate(kv_chunks):
            if kc < qc:
                yield qi, ki, False
            elif kc == qc:
                yield qi, ki, True


class RingAttention(torch.autograd.Function):
    """q [s_local, b, h, d] and k, v [s_local, b, hk, d] in the load-balanced layout of `group`; causal."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale: float, diagonal_causal: bool = True):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        halves = lambda x: x.chunk(2, dim=0)  # noqa: E731
        q_parts, q_chunks = halves(q), chunks_of(rank, size)
        outs = [torch.zeros(p.shape, dtype=torch.float32, device=q.device) for p in q_parts]
        lses = [torch.full((q.shape[1], q.shape[2], p.shape[0]), float("-inf"), device=q.device) for p in q_parts]
        kv = (k, v)
        for step in range(size):
            kv_chunks = chunks_of((rank - step) % size, size)
            if step + 1 < size:
                sending = kv
            k_parts, v_parts = halves(kv[0]), halves(kv[1])
            for qi, ki, causal in _pairs(q_chunks, kv_chunks):
                block = block_forward(q_parts[qi], k_parts[ki], v_parts[ki], scale, causal and diagonal_causal)
                outs[qi], lses[qi] = _merge(outs[qi], lses[qi], *block)
            if step + 1 < size:
                kv = _pass_on(sending, group)
        out, lse = torch.cat(outs), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.diagonal_causal = group, scale, diagonal_causal
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        halves = lambda x: x.chunk(2, dim=0)  # noqa: E731
        delta = (dout.float() * out).sum(-1).permute(1, 2, 0)  # [b, h, s_local]
        q_parts, dout_parts = halves(q), halves(dout)
        lse_parts, delta_parts = lse.chunk(2, dim=-1), delta.chunk(2, dim=-1)
        q_chunks = chunks_of(rank, size)
        dq_parts = [torch.zeros(p.shape, dtype=torch.float32, device=q.device) for p in q_parts]
        kv = (k, v)
        dkv = (torch.zeros(k.shape, dtype=torch.float32, device=q.device),
               torch.zeros(v.shape, dtype=torch.float32, device=q.device))
        for step in range(size):
            kv_chunks = chunks_of((rank - step) % size, size)
            k_parts, v_parts = halves(kv[0]), halves(kv[1])
            dk_parts, dv_parts = list(halves(dkv[0].clone())), list(halves(dkv[1].clone()))
            for qi, ki, causal in _pairs(q_chunks, kv_chunks):
                dq, dk, dv = block_backward(q_parts[qi], k_parts[ki], v_parts[ki], dout_parts[qi], lse_parts[qi],
                                            delta_parts[qi], scale, causal and ctx.diagonal_causal)
                dq_parts[qi] += dq
                dk_parts[ki] = dk_parts[ki] + dk
                dv_parts[ki] = dv_parts[ki] + dv
            dkv = (torch.cat(dk_parts), torch.cat(dv_parts))
            if step + 1 < size:
                *kv, dk_all, dv_all = _pass_on((*kv, *dkv), group)
                kv, dkv = tuple(kv), (dk_all, dv_all)
        if size > 1:  # one more hop brings each key/value gradient home
            dkv = tuple(_pass_on(dkv, group))
        return torch.cat(dq_parts).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, group, scale: float | None = None, diagonal_causal: bool = True):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if group is None or dist.get_world_size(group) == 1:  # one rank: its chunks are the whole sequence, in order
        return _LocalCausal.apply(q, k, v, scale, diagonal_causal)
    return RingAttention.apply(q, k, v, group, scale, diagonal_causal)


class _LocalCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal):
        out, lse = block_forward(q, k, v, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal = scale, causal
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        delta = (dout.float() * out).sum(-1).permute(1, 2, 0)
        dq, dk, dv = block_backward(q, k, v, dout, lse, delta, ctx.scale, ctx.causal)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


# --- Ulysses ------------------------------------------------------------------------------------------------------

def _sequence_order(size: int) -> list[int]:
    """After the all-to-all the group's parts arrive by rank, each [front chunk, back chunk]: the order of those
    2 x size parts that puts the fronts ascending, then the backs ascending (back chunks descend with the rank)."""
    return [2 * r for r in range(size)] + [2 * r + 1 for r in reversed(range(size))]


def _heads_to_sequence(x, group, head_order):
    """[s_local, b, h, d] -> [s_local * size, b, h / size, d] in the group's load-balanced order."""
    size = dist.get_world_size(group)
    s, b, h, d = x.shape
    parts = x.view(s, b, size, h // size, d)
    if head_order is not None:
        parts = parts[:, :, head_order]
    gathered = _AllToAll.apply(parts.permute(2, 0, 1, 3, 4), group)  # [size (source rank), s, b, h/size, d]
    halves = gathered.reshape(size * 2, s // 2, b, h // size, d)
    return halves[_sequence_order(size)].reshape(size * s, b, h // size, d)


def _sequence_to_heads(x, group):
    size = dist.get_world_size(group)
    s_all, b, hs, d = x.shape
    order = torch.tensor(_sequence_order(size), device=x.device)
    halves = x.view(2 * size, s_all // (2 * size), b, hs, d)[torch.argsort(order)]
    parts = halves.reshape(size, s_all // size, b, hs, d)
    back = _AllToAll.apply(parts, group)  # [size (head group), s_local, b, h/size, d]
    return back.permute(1, 2, 0, 3, 4).reshape(s_all // size, b, hs * size, d)


def ulysses_attention(q, k, v, ulysses_group, attend, head_order=None):
    """attend(q, k, v) on [s_local x U, b, heads / U, d] in the load-balanced layout of the rest of the group (a
    ring across Ulysses groups, or plain causal attention when Ulysses spans the whole CP group).
    head_order: only for the broken variant that gathers the heads in the wrong order."""
    if ulysses_group is None or dist.get_world_size(ulysses_group) == 1:
        return attend(q, k, v)
    parts = [_heads_to_sequence(x, ulysses_group, head_order) for x in (q, k, v)]
    return _sequence_to_heads(attend(*parts), ulysses_group)


def context_parallel_attention(q, k, v, ulysses_group, ring_group, scale: float | None = None,
                               diagonal_causal: bool = True, head_order=None, packed=None, cross_segments=False):
    """Causal attention of the CP group's sequence: Ulysses over ulysses_group, the ring over ring_group (either
    of size 1). q, k, v and the result: this CP rank's [s_local, b, heads, d]. packed: (segment lengths, CP size)
    of a pack (b = 1; context_parallel_packed)."""
    if packed is not None:
        from mm_adaptor.patches.transformer.context_parallel_packed import packed_attention

        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return packed_attention(q, k, v, ulysses_group, ring_group, scale, *packed, cross_segments=cross_segments,
                                head_order=head_order)
    return ulysses_attention(q, k, v, ulysses_group,
                             lambda *qkv: ring_attention(*qkv, ring_group, scale, diagonal_causal), head_order)


# --- megatron's local DotProductAttention ----------------------------------------------------------------------

def groups_for(cp_group, ulysses_degree: int, cache: dict):
    """(Ulysses group or None, ring group or None) of this rank inside cp_group: Ulysses over consecutive CP ranks,
    the ring over the ranks ulysses_degree apart. Made once per CP group, by its members only."""
    key = (id(cp_group), ulysses_degree)
    if key not in cache:
        ranks = dist.get_process_group_ranks(cp_group)
        size, rank = len(ranks), dist.get_rank(cp_group)
        ulysses = ring = None
        if ulysses_degree == size:
            ulysses = cp_group
        elif ulysses_degree == 1:
            ring = cp_group
        else:
            first = (rank // ulysses_degree) * ulysses_degree
            ulysses = dist.new_group(ranks[first:first + ulysses_degree], use_local_synchronization=True)
            ring = dist.new_group(ranks[rank % ulysses_degree::ulysses_degree], use_local_synchronization=True)
        cache[key] = (ulysses, ring)
    return cache[key]


def init_with_context_parallel(wrapped, instance, args, kwargs):
    """DotProductAttention.__init__ asserts context_parallel_size == 1 (only TE's attention has CP): it is built
    from a copy of the config that says 1 and then given the real one."""
    import copy

    config = kwargs["config"] if "config" in kwargs else args[0]
    if config.context_parallel_size == 1:
        return wrapped(*args, **kwargs)
    single = copy.copy(config)
    single.context_parallel_size = 1
    if "config" in kwargs:
        kwargs = dict(kwargs, config=single)
    else:
        args = (single, *args[1:])
    wrapped(*args, **kwargs)
    instance.config = config
    return None


ATTENTION_ARGUMENTS = ("query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias",
                       "packed_seq_params")


def forward_with_context_parallel(algo: str, ulysses_degree: int, calls: dict):
    """DotProductAttention.forward over the CP group (causal self-attention); megatron's own code where CP is 1."""
    from megatron.core import parallel_state

    from mm_adaptor.core.patching import bound_arguments

    cache: dict = {}

    def forward(wrapped, instance, args, kwargs):
        config = instance.config
        if config.context_parallel_size == 1:
            return wrapped(*args, **kwargs)
        bound = bound_arguments(ATTENTION_ARGUMENTS, args, kwargs)
        if bound.get("attention_bias") is not None:
            raise NotImplementedError("context parallelism with an attention bias is not supported")
        query, key, value = bound["query"], bound["key"], bound["value"]
        cp_group = getattr(instance, "cp_group", None) or parallel_state.get_context_parallel_group()
        ulysses, ring = groups_for(cp_group, ulysses_degree, cache)
        packed = bound.get("packed_seq_params")
        if packed is not None:  # THD: [t, heads, d] with the batch of 1 squeezed
            from mm_adaptor.patches.transformer.packed_attention import HOST_BOUNDS, segment_bounds

            cu_q, cu_kv = segment_bounds(packed)[:2]  # read on the host once per pack, not per layer
            segments = segment_lengths(cu_q if cu_q.device.type == "cpu" else HOST_BOUNDS.of(packed, cu_q, cu_kv)[0])
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
            out = context_parallel_attention(query, key, value, ulysses, ring, scale=instance.softmax_scale,
                                             packed=(segments, dist.get_world_size(cp_group)))
            calls[f"{algo} packed"] = calls.get(f"{algo} packed", 0) + 1
            return out.reshape(out.shape[0], -1)
        out = context_parallel_attention(query, key, value, ulysses, ring, scale=instance.softmax_scale)
        calls[algo] = calls.get(algo, 0) + 1
        return out.reshape(out.shape[0], out.shape[1], -1)

    return forward
