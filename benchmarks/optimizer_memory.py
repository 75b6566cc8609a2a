"""Optimizer and parameter memory, and step time, of a GPT of about 1B parameters on one rank (bf16, Adam, the
distributed optimizer): unpatched vs --reuse-fp32-param vs --swap-optimizer vs --virtual-optimizer vs Megatron's
own --optimizer-cpu-offload, each configuration in a fresh process, one after the other in one run.

Per configuration: median step time and optimizer-step time; parameter, gradient and optimizer bytes per
residence (mm_adaptor.devices.memory.model_state_bytes, exact); on CUDA the peak allocated device memory of the whole
run, on the CPU the peak resident memory of the process (where "host" is the same RAM, so moving state saves nothing
physical); for --swap-optimizer the bytes copied per step and the bandwidth that implies.

    python benchmarks/optimizer_memory.py                       # the device torch sees (CUDA if any)
    python benchmarks/optimizer_memory.py --device cpu --layers 18 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from _common import forked, init_single_rank, llama_like_driver_options

CONFIGS = {
    "unpatched": [],
    "reuse-fp32-param": ["--reuse-fp32-param"],
    "swap-optimizer": ["--swap-optimizer"],
    "virtual-optimizer": ["--virtual-optimizer"],
    "megatron optimizer-cpu-offload": [],
}
MEGATRON_OFFLOAD = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=18, help="18 layers of hidden 2048: 0.99B parameters")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=1, help="steps before measuring (the first makes Adam's state)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of: {', '.join(CONFIGS)}")
    p.add_argument("--start", choices=["spawn", "fork"], default="spawn",
                   help="how each configuration's process starts: fork shares this process's imports (CPU only)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # run this configuration here and print JSON
    args = p.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"--configs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    if args.start == "fork" and args.device != "cpu":
        p.error("--start fork: CPU only (a forked process cannot initialise CUDA)")
    return args


def driver_args(args, flags):
    return llama_like_driver_options(args, "--vocab-size", str(args.vocab), "--global-batch-size",
                                     str(args.micro_batch),
                                     "--untie-embeddings-and-output-weights", "--bf16", "--use-distributed-optimizer",
                                     "--train-iters", str(args.warmup + args.steps), *flags)


def run_one(args, name):
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import mm_adaptor
    from mm_adaptor import devices
    from mm_adaptor.api import feature_statistics
    from mm_adaptor.devices.memory import model_state_bytes
    from mm_adaptor.train.data import MockBatches
    from mm_adaptor.harness.runner.loop import RunState, _set_seeds, train_step
    from mm_adaptor.harness.runner.model import (build_model, build_optimizer, connect_grad_sync,
                                                 transformer_config, wrap_model)

    backend = devices.install("cpu" if args.device == "cpu" else None)
    options = driver_args(args, CONFIGS[name])
    mm_adaptor.enable(options)
    init_single_rank(backend.dist_backend)
    init_num_microbatches_calculator(0, None, options.global_batch_size, options.micro_batch_size, 1)
    _set_seeds(options.seed)
    device = backend.torch_device()
    config = transformer_config(options)
    state = RunState(args=options)
    state.model = wrap_model(options, config, build_model(options, config, device))
    extra = MEGATRON_OFFLOAD if name == "megatron optimizer-cpu-offload" else {}
    state.optimizer, state.scheduler = build_optimizer(options, config, state.model, **extra)
    config.grad_scale_func = state.optimizer.scale_loss
    connect_grad_sync(options, config, state.model)
    data = [MockBatches(options, 0, 0, device)]
    step_ms, optimizer_ms = [], []
    inner_step = state.optimizer.step

    def timed_optimizer_step():
        start = time.perf_counter()
        result = inner_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        optimizer_ms.append((time.perf_counter() - start) * 1e3)
        return result

    state.optimizer.step = timed_optimizer_step
    fb = get_forward_backward_func()
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(state, data, fb)
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - start) * 1e3)
        print(f"#     {name}: step {i + 1} {step_ms[-1]:.0f} ms (optimizer {optimizer_ms[-1]:.0f} ms)", file=sys.stderr,
              flush=True)
    memory = model_state_bytes(state.model, state.optimizer, device)
    parameters = sum(p.numel() for chunk in state.model for p in chunk.parameters())
    stats = feature_statistics()
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    measured = slice(args.warmup, None)
    print(json.dumps(dict(name=name, parameters=parameters, step_ms=statistics.median(step_ms[measured]),
                          optimizer_ms=statistics.median(optimizer_ms[measured]), peak=peak,
                          device_bytes=memory["device_bytes"], host_bytes=memory["host_bytes"],
                          by_residence=memory["by_residence"], statistics=stats)))


def main(argv=None):
    args = parse_args(argv)
    if args.one:
        return run_one(args, args.one)
    from _common import device_name

    rows = []
    if args.start == "fork":  # what run_one imports, once, before the forks
        import mm_adaptor.harness.runner.model  # noqa: F401
    for name in args.configs.split(","):
        if args.start == "fork":
            returncode, stdout, stderr = forked(lambda name=name: run_one(args, name))
            print(stderr, end="", file=sys.stderr)  # its progress lines and errors, as a child's own
        else:
            child = [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:]), "--one", name]
            done = subprocess.run(child, stdout=subprocess.PIPE, text=True)
            returncode, stdout = done.returncode, done.stdout
        if returncode:
            print(f"#   {name}: failed (exit {returncode}); its error is above", file=sys.stderr, flush=True)
            rows.append(dict(name=name, failed=returncode))
            continue
        rows.append(json.loads(stdout.strip().splitlines()[-1]))
    ok = [r for r in rows if "failed" not in r]
    if not ok:
        return 1
    print(f"# {ok[0]['parameters'] / 1e9:.2f}B parameters ({args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, "
          f"vocab {args.vocab}), bf16, Adam, distributed optimizer on 1 rank, seq {args.seq} x micro-batch "
          f"{args.micro_batch}; {device_name(args.device)}; median of {args.steps} steps after {args.warmup}")
    base = ok[0]
    peak_label = "peak allocated" if args.device == "cuda" else "peak RSS"
    gib = 2 ** 30
    print(f"| configuration | step ms | vs {base['name']} | optimizer step ms | model state on device GiB | "
          f"in host memory GiB | {peak_label} GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['name']} | failed (exit {r['failed']}) | | | | | |")
            continue
        print(f"| {r['name']} | {r['step_ms']:.0f} | {r['step_ms'] / base['step_ms']:.3f}x | {r['optimizer_ms']:.0f} | "
              f"{r['device_bytes'] / gib:.2f} | {r['host_bytes'] / gib:.2f} | {r['peak'] / gib:.2f} |")
    for r in ok:
        swap = r["statistics"].get("swap-optimizer") if r["statistics"] else None
        if swap and swap.get("steps"):
            per_step = (swap["bytes_to_device"] + swap["bytes_to_host"]) / swap["steps"]
            print(f"# {r['name']}: {per_step / 1e9:.2f} GB copied per step (both ways), "
                  f"{per_step / 1e6 / r['optimizer_ms']:.2f} GB/s over the optimizer step")
    return 1 if len(ok) < len(rows) else 0  # a failed configuration fails the command, after the table


if __name__ == "__main__":
    sys.exit(main())
