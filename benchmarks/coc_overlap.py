"""--use-coc at TP2 with sequence parallelism: one transformer layer's four linears (qkv and fc1 column-parallel,
proj and fc2 row-parallel), forward + backward, Megatron's own path against the chunked one for each N, two ranks
over gloo (or NCCL with --device cuda on two GPUs), side by side in one run; outputs and gradients checked equal
first. It then measures what the cost model needs (GEMM throughput, the collectives' bandwidth and latency) and
prints the model's prediction beside each measurement (benchmarks/coc_cost_model.py)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import coc_cost_model as model  # noqa: E402

TP = 2


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, iters, warmup, device):
    """Median over iterations of the slowest rank's time, in seconds."""
    samples = []
    for i in range(warmup + iters):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            samples.append(elapsed.item())
    return statistics.median(samples)


def _build(args, device, rank):
    gen = torch.Generator().manual_seed(1234)
    h, f = args.hidden, args.ffn

    def weight(out, inp):  # this rank's shard of a whole weight, same whole weight on every rank
        return (torch.randn(out, inp, generator=gen) * inp ** -0.5).to(device, args.dtype).requires_grad_()

    qkv, proj, fc1, fc2 = weight(3 * h, h), weight(h, h), weight(2 * f, h), weight(h, f)
    shards = {"qkv": qkv.detach()[rank * 3 * h // TP:(rank + 1) * 3 * h // TP].clone().requires_grad_(),
              "proj": proj.detach()[:, rank * h // TP:(rank + 1) * h // TP].clone().requires_grad_(),
              "fc1": fc1.detach()[rank * 2 * f // TP:(rank + 1) * 2 * f // TP].clone().requires_grad_(),
              "fc2": fc2.detach()[:, rank * f // TP:(rank + 1) * f // TP].clone().requires_grad_()}
    x = torch.randn(args.seq // TP, args.micro_batch, h, generator=torch.Generator().manual_seed(rank))
    return shards, x.to(device, args.dtype).requires_grad_()


def _layer(shards, x, chunks, group):
    """qkv -> (first h/TP columns) -> proj -> fc1 -> (first ffn/TP columns) -> fc2, as a layer's linears chain."""
    from megatron.core.tensor_parallel import layers, mappings

    from mm_adaptor.patches.tensor_parallel import coc

    def column(inp, w):
        if chunks <= 1:  # --coc-parallel-num 1 runs megatron's own path
            return layers.linear_with_grad_accumulation_and_async_allreduce(inp, w, None, False, False, True,
                                                                             tp_group=group)
        return coc.AllGatherMatmul.apply(inp, w, None, False, chunks, group)

    def row(inp, w):
        if chunks <= 1:
            out = layers.linear_with_grad_accumulation_and_async_allreduce(inp, w, None, False, False, False,
                                                                            tp_group=group)
            return mappings.reduce_scatter_to_sequence_parallel_region(out, group=group)
        return coc.MatmulReduce.apply(inp, w, False, True, chunks, group)

    h_shard, f_shard = shards["proj"].shape[1], shards["fc2"].shape[1]
    y = row(column(x, shards["qkv"])[..., :h_shard], shards["proj"])
    return row(column(y, shards["fc1"])[..., :f_shard], shards["fc2"])


def _forward_backward(shards, x, chunks, group):
    for t in (*shards.values(), x):
        t.grad = None
    out = _layer(shards, x, chunks, group)
    out.backward(torch.ones_like(out))
    return out


def _measure_machine(args, device, group) -> model.Machine:
    """GEMM FLOP/s on the layer's own shapes, gloo/NCCL all-gather bus bandwidth and latency."""
    tokens, h, f = args.seq * args.micro_batch, args.hidden, args.ffn
    a = torch.randn(tokens, h, device=device, dtype=args.dtype)
    b = torch.randn(h, 2 * f // TP, device=device, dtype=args.dtype)
    gemm = _timed(lambda: a.mm(b), args.iters, args.warmup, device)
    local = torch.randn(tokens // TP, h, device=device, dtype=args.dtype)
    whole = torch.empty(tokens, h, device=device, dtype=args.dtype)
    gather = _timed(lambda: dist.all_gather_into_tensor(whole, local, group=group), args.iters, args.warmup, device)
    tiny, tiny_whole = local[:1, :1].contiguous(), whole[:TP, :1].contiguous()
    latency = _timed(lambda: dist.all_gather_into_tensor(tiny_whole, tiny, group=group), args.iters, args.warmup,
                     device)
    moved = (TP - 1) / TP * whole.numel() * whole.element_size()
    return model.Machine(f"measured ({dist.get_backend()})", 2 * tokens * h * (2 * f // TP) / gemm,
                         moved / max(gather - latency, 1e-9), latency)


def _worker(rank, args, port, results):
    import warnings

    warnings.simplefilter("ignore")  # megatron's notices about Apex and Transformer Engine, torch deprecations
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=TP)
    from megatron.core import parallel_state

    from mm_adaptor import devices

    devices.install(device)
    parallel_state.initialize_model_parallel(TP, 1)
    group = parallel_state.get_tensor_model_parallel_group()
    try:
        shards, x = _build(args, device, rank)
        reference = _forward_backward(shards, x, 0, group).detach().clone()
        grads = [t.grad.clone() for t in (*shards.values(), x)]
        for n in args.chunks:
            out = _forward_backward(shards, x, n, group)
            assert torch.equal(out, reference), f"N={n}: outputs differ from megatron's"
            for got, want in zip((*shards.values(), x), grads):
                assert torch.equal(got.grad, want), f"N={n}: gradients differ from megatron's"
        times = {n: _timed(lambda n=n: _forward_backward(shards, x, n, group), args.iters, args.warmup, device)
                 for n in (0, *args.chunks)}
        machine = _measure_machine(args, device, group)
        if rank == 0:
            results["times"], results["machine"] = times, machine
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--chunks", default="2,4,8", help="--coc-parallel-num values (1 is megatron's path)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (CPU)")
    parser.add_argument("--start", choices=["spawn", "fork"], default="spawn",
                        help="how the ranks start: fork shares this process's imports (a quicker start)")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    args.chunks = [int(n) for n in args.chunks.split(",")]
    if args.seq % (TP * max(args.chunks)) and args.seq % TP:
        parser.error(f"--seq {args.seq} must divide by {TP}")
    results = mp.Manager().dict()
    if args.start == "fork":  # what a rank imports, once, before the fork
        import megatron.core.tensor_parallel  # noqa: F401

        import mm_adaptor.patches.tensor_parallel.coc  # noqa: F401
    mp.start_processes(_worker, args=(args, _free_port(), results), nprocs=TP, join=True, start_method=args.start)
    times, machine = results["times"], results["machine"]
    layer = model.Layer(args.hidden, args.ffn, args.seq, args.micro_batch, TP,
                        torch.empty(0, dtype=args.dtype).element_size(), swiglu=True)
    print(f"# TP{TP} + sequence parallelism over {machine.name.split('(')[1].rstrip(')')}, {args.device}, "
          f"{args.threads} thread(s) per rank, torch {torch.__version__}; layer: hidden {args.hidden}, ffn "
          f"{args.ffn}, seq {args.seq} x micro-batch {args.micro_batch}, {str(args.dtype).split('.')[1]}; "
          f"median of {args.iters} after {args.warmup}, the slowest rank's time")
    print(f"# measured for the model: GEMM {machine.flops / 1e9:.2f} GFLOP/s, all-gather bus bandwidth "
          f"{machine.bandwidth / 1e9:.3f} GB/s, latency {machine.latency * 1e6:.0f} us per collective")
    columns = ["configuration", "measured ms", "vs megatron", "predicted ms", "predicted vs megatron"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    predicted_megatron = model.layer_seconds(layer, machine, 0)
    for n, seconds in times.items():
        name = "megatron (unpatched)" if n == 0 else f"--use-coc --coc-parallel-num {n}"
        predicted = model.layer_seconds(layer, machine, n)
        print(f"| {name} | {seconds * 1e3:.2f} | {times[0] / seconds:.3f}x | {predicted * 1e3:.2f} | "
              f"{predicted_megatron / predicted:.3f}x |", flush=True)
    return dict(times)


if __name__ == "__main__":
    main()
