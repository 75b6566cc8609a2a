"""A cost model of --use-coc: per transformer layer under TP + sequence parallelism, the time of its four linears
(qkv and fc1 column-parallel, proj and fc2 row-parallel), forward and backward, with Megatron's schedule and with
the work split into N chunks; the time saved and the best N.

Inputs: GEMM throughput (FLOP/s), the link's bus bandwidth for all-gather/reduce-scatter (bytes/s per rank) and
its latency per collective, a GEMM's fixed cost per call, and the layer's sizes. A collective moving a tensor of X
bytes (gathered size) costs (tp-1)/tp * X / bandwidth + latency. Megatron's schedule (0.16, local spec):
forward: all-gather then GEMM (column), GEMM then reduce-scatter (row), nothing overlapped; backward of a
column-parallel linear: its input re-gather overlaps the input-gradient GEMM and the reduce-scatter overlaps the
weight-gradient GEMM; backward of a row-parallel linear: all-gather, then both GEMMs. Chunked (a pipeline of N
stages): N collectives and N GEMMs, each chunk's collective overlapping another chunk's GEMM:
    (m + c) / N + (N - 1) * max(m, c) / N,   m and c the total communication and compute.
What it leaves out: the smaller GEMMs' efficiency (only a fixed cost per call), contention between the compute and
the collectives for memory bandwidth and cores, and the other work of a layer (attention, norms).

`python benchmarks/coc_cost_model.py` prints the table for a 70B-class layer at TP8 on NVLink- and PCIe-class
links; benchmarks/coc_overlap.py feeds it what it measures at TP2 over gloo and prints prediction beside
measurement."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

CHUNK_CHOICES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Machine:
    name: str
    flops: float  # GEMM FLOP/s achieved
    bandwidth: float  # bus bandwidth of all-gather / reduce-scatter, bytes/s
    latency: float  # seconds per collective call
    gemm_overhead: float = 0.0  # seconds per GEMM call


@dataclass(frozen=True)
class Layer:
    hidden: int
    ffn: int
    seq: int
    micro_batch: int
    tp: int
    element_bytes: int = 2
    qkv_out: int | None = None  # default 3 x hidden (no grouped-query attention)
    swiglu: bool = True

    def linears(self) -> list[tuple[str, str, int, int]]:
        """(name, column|row, in features, out features) of the whole (unsplit) linears."""
        return [("qkv", "column", self.hidden, self.qkv_out or 3 * self.hidden),
                ("proj", "row", self.hidden, self.hidden),
                ("fc1", "column", self.hidden, (2 if self.swiglu else 1) * self.ffn),
                ("fc2", "row", self.ffn, self.hidden)]

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch


def pipeline(comm: float, compute: float, chunks: int) -> float:
    return (comm + compute) / chunks + (chunks - 1) * max(comm, compute) / chunks


def linear_times(layer: Layer, machine: Machine, kind: str, k: int, n: int, chunks: int) -> dict:
    """Seconds of one linear's forward and backward; chunks 0 or 1: Megatron's schedule."""
    tp, tokens = layer.tp, layer.tokens
    gemm = 2 * tokens * k * n / tp / machine.flops  # one of forward, input gradient, weight gradient
    # the activation crossing the link: the gathered (column) or reduced (row) [tokens, hidden] tensor
    moved = tokens * (k if kind == "column" else n) * layer.element_bytes
    calls = max(chunks, 1)
    comm = (tp - 1) / tp * moved / machine.bandwidth + calls * machine.latency
    compute = gemm + calls * machine.gemm_overhead
    if chunks <= 1:  # --coc-parallel-num 1 runs megatron's own path
        forward = comm + compute
        if kind == "column":  # re-gather || input gradient, then reduce-scatter || weight gradient
            backward = max(comm, compute) + max(comm, compute)
        else:  # all-gather, then both GEMMs
            backward = comm + 2 * compute
    else:
        forward = pipeline(comm, compute, chunks)
        if kind == "column":  # re-gather and reduce-scatters share the link from the first chunk's GEMM on
            backward = max(2 * compute, 2 * comm + compute / chunks)
        else:
            backward = pipeline(comm, compute, chunks) + compute
    return {"forward": forward, "backward": backward}


def layer_seconds(layer: Layer, machine: Machine, chunks: int) -> float:
    """One layer's linears, forward + backward; chunks: --coc-parallel-num (0 or 1: Megatron's schedule)."""
    return sum(sum(linear_times(layer, machine, kind, k, n, chunks).values())
               for _name, kind, k, n in layer.linears())


def predict(layer: Layer, machine: Machine) -> dict:
    megatron = layer_seconds(layer, machine, 0)
    coc = {n: layer_seconds(layer, machine, n) for n in CHUNK_CHOICES}
    best = min(coc, key=coc.get)
    return {"megatron": megatron, "coc": coc, "best": best, "saved": megatron - coc[best]}


# A 70B-class layer (Llama-2-70B: hidden 8192, SwiGLU ffn 28672, 8 KV heads of 128), seq 4096, TP8, bf16.
LAYER_70B_TP8 = Layer(hidden=8192, ffn=28672, seq=4096, micro_batch=1, tp=8, qkv_out=8192 + 2 * 8 * 128)
# Illustrative links (assumptions, not measurements): an H100-class GPU at 600 TFLOP/s in bf16 GEMMs with NVLink
# (about 350 GB/s all-gather bus bandwidth, 15 us per collective) or PCIe Gen5 only (about 20 GB/s, 30 us).
MACHINES = (Machine("NVLink-class", 600e12, 350e9, 15e-6, 5e-6),
            Machine("PCIe-class", 600e12, 20e9, 30e-6, 5e-6))


def print_table(layer: Layer, machines) -> None:
    print(f"# layer: hidden {layer.hidden}, ffn {layer.ffn}, seq {layer.seq} x micro-batch {layer.micro_batch}, "
          f"TP{layer.tp}, {layer.element_bytes} B per element; times per layer, forward + backward of its linears")
    columns = ["link", "GEMM TFLOP/s", "bus GB/s", "latency us", "megatron ms",
               *(f"N={n} ms" for n in CHUNK_CHOICES), "best N", "saved ms", "saved %"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for machine in machines:
        p = predict(layer, machine)
        print(f"| {machine.name} | {machine.flops / 1e12:g} | {machine.bandwidth / 1e9:g} | {machine.latency * 1e6:g} "
              f"| {p['megatron'] * 1e3:.3f} | " + " | ".join(f"{p['coc'][n] * 1e3:.3f}" for n in CHUNK_CHOICES)
              + f" | {p['best']} | {p['saved'] * 1e3:.3f} | {100 * p['saved'] / p['megatron']:.1f}% |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=LAYER_70B_TP8.hidden)
    parser.add_argument("--ffn", type=int, default=LAYER_70B_TP8.ffn)
    parser.add_argument("--qkv-out", type=int, default=LAYER_70B_TP8.qkv_out)
    parser.add_argument("--seq", type=int, default=LAYER_70B_TP8.seq)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--tp", type=int, default=LAYER_70B_TP8.tp)
    parser.add_argument("--element-bytes", type=int, default=2)
    args = parser.parse_args(argv)
    layer = Layer(args.hidden, args.ffn, args.seq, args.micro_batch, args.tp, args.element_bytes, args.qkv_out)
    print_table(layer, MACHINES)


if __name__ == "__main__":
    main()
