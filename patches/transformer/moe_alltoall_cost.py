"""--moe-alltoall-overlap-comm's cost model: one MoE layer's forward + backward per rank with megatron's schedule and
with the chunked one, from the link's rate and latency, the experts' GEMM rate and the layer's sizes (used by
benchmarks/moe_overlap.py and docs/features/moe-alltoall-overlap-comm.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s one rank sends (and receives) through an all-to-all
    latency: float  # seconds per all-to-all call
    flops: float  # the experts' GEMM rate, FLOP/s


def schedule(dispatch: list[float], compute: list[float], combine: list[float], shared: float = 0.0) -> float:
    """Seconds of one pass of the chunked schedule: one link (a FIFO: every dispatch is queued at 0, each combine
    when its chunk's experts are done) and one compute engine (the shared experts first, then the chunks in order,
    each once its dispatch has arrived). Megatron's schedule is the same with one chunk and the shared experts
    before the dispatch (they wait for nothing either way)."""
    link_free, arrived = 0.0, []
    for d in dispatch:
        link_free += d
        arrived.append(link_free)
    engine = shared
    end = link_free
    for a, m, c in zip(arrived, compute, combine):
        engine = max(engine, a) + m
        start = max(engine, link_free)
        link_free = start + c
        end = link_free
    return max(end, engine)


def predict(tokens: int, hidden: int, ffn: int, topk: int, experts: int, ep: int, chunks: int, link: Link, *,
            element_bytes: int = 2, swiglu: bool = True, shared_ffn: int = 0) -> dict:
    """One MoE layer's forward + backward per rank with megatron's schedule and with the chunked one, under balanced
    routing (each rank receives tokens x topk rows, (ep - 1) / ep of them from other ranks). Backward: the same
    communication reversed and twice the GEMM work. Returns the seconds and the hidden fraction of the
    communication: (t_comm + t_compute - t_overlapped) / t_comm."""
    rows = tokens * topk
    remote = rows * hidden * element_bytes * (ep - 1) / ep
    fc1_out = (2 if swiglu else 1) * ffn
    flop = 2 * rows * hidden * (fc1_out + ffn)  # forward GEMMs of the local experts
    shared_flop = 2 * tokens * hidden * ((2 if swiglu else 1) * shared_ffn + shared_ffn)

    def one_pass(n: int, factor: int) -> tuple[float, float, float]:
        a2a = remote / link.bandwidth / n + link.latency
        m, s = factor * flop / link.flops / n, factor * shared_flop / link.flops
        comm = 2 * n * a2a  # dispatch and combine
        if n == 1:
            return comm + m + s, comm, m + s  # megatron: nothing overlapped
        return schedule([a2a] * n, [m] * n, [a2a] * n, s), comm, n * m + s

    t_megatron = sum(one_pass(1, f)[0] for f in (1, 2))
    passes = [one_pass(chunks, f) for f in (1, 2)]
    t_overlap = sum(p[0] for p in passes)
    comm, compute = sum(p[1] for p in passes), sum(p[2] for p in passes)
    return {"megatron s": t_megatron, "overlapped s": t_overlap, "comm s": comm, "compute s": compute,
            "hidden fraction": (comm + compute - t_overlap) / comm if comm else 0.0,
            "gain": t_megatron / t_overlap - 1}
