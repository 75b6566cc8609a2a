"""--moe-alltoall-overlap-comm on the CPU over gloo: how much of the MoE layer's all-to-all time the chunked schedule
hides, measured, beside the cost model's prediction (mm_adaptor.patches.transformer.moe_alltoall_overlap.predict).

python benchmarks/moe_overlap.py [--ep 2] [--tokens 2048] [--hidden 512] [--ffn 64] [--experts 8] [--topk 2]
                                 [--shared-ffn 0] [--chunks 2,4]

Each EP rank is a process with one gloo rank and --threads intra-op threads; it builds megatron's MoELayer (local spec,
SequentialMLP experts, the alltoall dispatcher, fp32) and runs forward + backward on the same input:
- first unpatched, then with the feature's patches for each chunk count: output, input gradient and every parameter
  gradient must be equal bit for bit (the script stops otherwise);
- then timed (median of --iters after --warmup, the slowest rank's time): the unpatched layer (t_megatron), the
  patched one (t_overlapped), and the communication alone (t_comm: the layer's own all-to-alls with its own splits
  and sizes, back to back: dispatch tokens and probabilities, combine, and their reverses in backward).
t_compute = t_megatron - t_comm (the unpatched layer is communication then compute, nothing overlapped);
hidden fraction = (t_comm + t_compute - t_overlapped) / t_comm = (t_megatron - t_overlapped) / t_comm.
The model is fed the measured all-to-all rate and latency and the experts' GEMM rate on this machine."""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _timed(fn, iters, warmup):
    samples = []
    for i in range(warmup + iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            samples.append(elapsed.item())
    return statistics.median(samples)


def _submodules(spec):
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules


def build(args):
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn, moe_ffn_hidden_size=args.ffn,
        num_attention_heads=8, num_moe_experts=args.experts, moe_router_topk=args.topk,
        moe_token_dispatcher_type="alltoall", expert_model_parallel_size=args.ep, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False, use_cpu_initialization=True,
        moe_shared_expert_intermediate_size=args.shared_ffn or None, moe_aux_loss_coeff=0.0)
    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False)
    torch.manual_seed(1234)  # the same router and shared experts on every rank, each rank's own experts after
    mlp = _submodules(spec).mlp
    # megatron-core 0.19's specs are functools.partial(MoELayer, submodules=...); 0.16's ModuleSpecs
    return mlp(config=config) if isinstance(mlp, functools.partial) else build_module(mlp, config=config)


def forward_backward(layer, x, grad):
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    out, _ = layer(x)
    out.backward(grad)
    return out


def snapshot(layer, x, out):
    return [out.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]


def comm_alone(layer, args):
    """The layer's all-to-alls alone, with its own splits: dispatch (tokens, probabilities), combine, and the
    backward's reverses of the three."""
    d = layer.token_dispatcher
    send, recv = [int(n) for n in d.input_splits], [int(n) for n in d.output_splits]
    group = d.ep_group
    tokens = torch.randn(sum(send), args.hidden)
    received = torch.empty(sum(recv), args.hidden)
    probs, probs_in = torch.randn(sum(send)), torch.empty(sum(recv))

    def run():
        for _ in range(2):  # forward, then backward's reverses
            dist.all_to_all_single(received, tokens, recv, send, group=group)
            dist.all_to_all_single(probs_in, probs, recv, send, group=group)
            dist.all_to_all_single(tokens, received, send, recv, group=group)

    return run, sum(send) * args.hidden * 4, send


def _worker(rank, args, port, results):
    import warnings

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.ep)
    from megatron.core import parallel_state

    from mm_adaptor import devices
    from mm_adaptor.feature_flags.moe_alltoall_overlap import overlap_patch_sets

    devices.install("cpu")
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=args.ep)
    try:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
        layer = build(args)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(args.tokens, 1, args.hidden, generator=gen).requires_grad_()
        grad = torch.randn(args.tokens, 1, args.hidden, generator=gen)
        step = functools.partial(forward_backward, layer, x, grad)
        reference = snapshot(layer, x, step())
        sets = {}
        for n in args.chunks:
            from collections import Counter

            counts = Counter()
            sets[n] = (overlap_patch_sets("moe-alltoall-overlap-comm", n, counts)[0], counts)
            sets[n][0].apply()
            try:
                got = snapshot(layer, x, step())
            finally:
                sets[n][0].revert()
            for i, (a, b) in enumerate(zip(got, reference)):
                assert torch.equal(a, b), f"chunks {n}: tensor {i} differs from megatron's"
            assert counts["dispatch all-to-alls issued async"] == n, counts
        times = {0: _timed(step, args.iters, args.warmup)}
        for n in args.chunks:
            sets[n][0].apply()
            try:
                times[n] = _timed(step, args.iters, args.warmup)
            finally:
                sets[n][0].revert()
        run, nbytes, send = comm_alone(layer, args)
        t_comm = _timed(run, args.iters, args.warmup)
        tiny = torch.zeros(args.ep)
        tiny_out = torch.empty(args.ep)
        latency = _timed(lambda: dist.all_to_all_single(tiny_out, tiny, group=layer.token_dispatcher.ep_group),
                         args.iters, args.warmup)
        expert = layer.experts.local_experts[0]
        rows = torch.randn(args.tokens * args.topk // max(args.experts // args.ep, 1), args.hidden)
        probs = torch.ones(rows.shape[0])
        t_gemm = _timed(lambda: expert(rows, probs), args.iters, args.warmup)
        if rank == 0:
            results.update(times=times, t_comm=t_comm, latency=latency, nbytes=nbytes, send=send,
                           flops=2 * rows.shape[0] * args.hidden * 3 * args.ffn / t_gemm)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def main(argv=None) -> dict:
    from mm_adaptor.patches.transformer import moe_alltoall_overlap as ao
    from mm_adaptor.ranks.launcher import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--shared-ffn", type=int, default=0, help="shared experts' ffn size (0: none)")
    parser.add_argument("--chunks", default="2,4", help="chunk counts to run (each at most the local experts)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--start", choices=["spawn", "fork"], default="spawn",
                        help="how the ranks start: fork shares this process's imports (a quicker start)")
    args = parser.parse_args(argv)
    args.chunks = [int(n) for n in args.chunks.split(",")]
    local = args.experts // args.ep
    if any(not 1 <= n <= local for n in args.chunks):
        parser.error(f"--chunks: each 1 to {local} (the local experts)")
    results = mp.Manager().dict()
    if args.start == "fork":  # what a rank imports, once, before the fork
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401

        import mm_adaptor.feature_flags.moe_alltoall_overlap  # noqa: F401
    mp.start_processes(_worker, args=(args, free_port(), results), nprocs=args.ep, join=True,
                       start_method=args.start)
    times, t_comm, latency = results["times"], results["t_comm"], results["latency"]
    # the model's link: 6 all-to-alls of the measured time, less their latency, moved these bytes (3 of tokens)
    remote = results["nbytes"] * (args.ep - 1) / args.ep
    bandwidth = 4 * remote / max(t_comm - 6 * latency, t_comm / 2)  # gloo latency is noisy: at most half
    link = ao.Link(bandwidth, latency, results["flops"])
    print(f"# EP{args.ep} over gloo, cpu, {args.threads} thread(s) per rank, torch {torch.__version__}; MoE layer: "
          f"{args.tokens} tokens per rank, hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, "
          f"top-{args.topk}, shared ffn {args.shared_ffn or 'none'}, fp32; median of {args.iters} after "
          f"{args.warmup}, the slowest rank's time; outputs and gradients equal to megatron's bit for bit for "
          f"every chunk count")
    print(f"# measured: all-to-alls alone {t_comm * 1e3:.2f} ms per forward+backward; all-to-all latency "
          f"{latency * 1e6:.0f} us, rate {bandwidth / 1e9:.3f} GB/s; experts' GEMMs {link.flops / 1e9:.2f} GFLOP/s")
    columns = ["configuration", "measured ms", "vs megatron", "t_comm ms", "t_compute ms", "hidden fraction",
               "predicted ms", "predicted hidden"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    t_megatron = times[0]
    t_compute = t_megatron - t_comm
    out = {}
    for n, seconds in times.items():
        name = "megatron (unpatched)" if n == 0 else f"--moe-alltoall-overlap-comm, {n} chunks"
        hidden = (t_comm + t_compute - seconds) / t_comm
        p = ao.predict(args.tokens, args.hidden, args.ffn, args.topk, args.experts, args.ep, max(n, 1), link,
                       element_bytes=4, shared_ffn=args.shared_ffn)
        predicted = p["megatron s"] if n == 0 else p["overlapped s"]
        predicted_hidden = 0.0 if n == 0 else p["hidden fraction"]
        print(f"| {name} | {seconds * 1e3:.2f} | {t_megatron / seconds:.3f}x | {t_comm * 1e3:.2f} | "
              f"{t_compute * 1e3:.2f} | {hidden:.2f} | {predicted * 1e3:.2f} | {predicted_hidden:.2f} |", flush=True)
        out[n] = hidden
    return out


if __name__ == "__main__":
    main()
