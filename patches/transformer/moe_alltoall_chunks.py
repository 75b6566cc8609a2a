"""--moe-alltoall-overlap-comm's chunks: which rows of megatron's permuted tokens each chunk of local experts sends,
what it receives, and the orders that give each expert megatron's rows (patches/transformer/moe_alltoall_overlap.py
runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def chunk_bounds(local_experts: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk's local experts: contiguous groups, the first ones one larger when uneven."""
    if not 1 <= chunks <= local_experts:
        raise ValueError(f"{chunks} chunks of {local_experts} local experts")
    base, extra = divmod(local_experts, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass
class Chunk:
    experts: tuple[int, int]  # [start, end) of local experts
    send_rows: list[int]  # rows of this rank's permuted tokens, in send order ([destination rank][expert])
    send_splits: list[int]  # per EP rank
    recv_splits: list[int]  # per EP rank, at this rank's expert-TP rank
    gather_sizes: list[int]  # per expert-TP rank (after the all-to-all)
    to_expert_major: list[int]  # [tp][ep][expert] rows -> [expert][tp][ep] rows
    tokens_per_expert: list[int]  # rows of each of the chunk's experts, gathered over TP
    from_expert_major: list[int] = field(default_factory=list)  # the inverse


def plan(local_counts: list[int], counts: list[list[list[int]]], tp_rank: int, chunks: int) -> list[Chunk]:
    """local_counts: this rank's tokens per global expert (ep x L, megatron's permuted order); counts[t][r][j]: the
    tokens expert-TP rank t of EP rank r sends to local expert j of this rank (megatron's
    num_global_tokens_per_local_expert). Returns each chunk's rows, splits and orders."""
    tp, ep, experts = len(counts), len(counts[0]), len(counts[0][0])
    if len(local_counts) != ep * experts:
        raise ValueError(f"{len(local_counts)} experts' counts for {ep} ranks of {experts} local experts")
    offsets = [0]
    for n in local_counts:
        offsets.append(offsets[-1] + n)
    out = []
    for j0, j1 in chunk_bounds(experts, chunks):
        send_rows, send_splits = [], []
        for r in range(ep):
            start, end = offsets[r * experts + j0], offsets[r * experts + j1]
            send_rows.extend(range(start, end))
            send_splits.append(end - start)
        recv_splits = [sum(counts[tp_rank][r][j0:j1]) for r in range(ep)]
        gather_sizes = [sum(sum(counts[t][r][j0:j1]) for r in range(ep)) for t in range(tp)]
        # the gathered chunk is [t][r][j in chunk]; megatron's experts see [j][t][r]
        start_of, row = {}, 0
        for t in range(tp):
            for r in range(ep):
                for j in range(j0, j1):
                    start_of[t, r, j] = row
                    row += counts[t][r][j]
        order, per_expert = [], []
        for j in range(j0, j1):
            n = 0
            for t in range(tp):
                for r in range(ep):
                    order.extend(range(start_of[t, r, j], start_of[t, r, j] + counts[t][r][j]))
                    n += counts[t][r][j]
            per_expert.append(n)
        inverse = [0] * len(order)
        for i, src in enumerate(order):
            inverse[src] = i
        out.append(Chunk((j0, j1), send_rows, send_splits, recv_splits, gather_sizes, order, per_expert, inverse))
    return out


def counts_of(dispatcher) -> tuple[list[int], list[list[list[int]]]]:
    """This rank's tokens per global expert and the [tp][ep][local expert] counts, from the dispatcher's state after
    megatron's dispatch_preprocess."""
    local = dispatcher.routing_map.sum(dim=0).tolist()
    tp, ep, experts = dispatcher.tp_size, dispatcher.ep_size, dispatcher.num_local_experts
    if experts > 1:
        flat = torch.as_tensor(dispatcher.num_global_tokens_per_local_expert).reshape(-1).tolist()
        counts = [[flat[(t * ep + r) * experts:(t * ep + r + 1) * experts] for r in range(ep)] for t in range(tp)]
    else:  # megatron keeps the splits only: one expert, so one chunk, in the order they give
        mine = [int(n) for n in _host_list(dispatcher.output_splits)]
        per_tp = [int(n) for n in _host_list(dispatcher.output_splits_tp)] if tp > 1 else [sum(mine)]
        counts = [[[n] for n in mine] if t == dispatcher.tp_rank else
                  [[per_tp[t]]] + [[0]] * (ep - 1) for t in range(tp)]
    return local, counts


def _host_list(values) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)
