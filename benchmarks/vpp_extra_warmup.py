"""--vpp-extra-warmup on the CPU: wall-clock per training step of megatron's interleaved schedule with and without
the extra warm-up, PP2+VPP2 (2 gloo ranks) and PP4+VPP2 (4 gloo ranks), one configuration after the other in one
run, each a fresh `mm-adaptor train`; the mean iteration time is the driver's own (first iteration excluded)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

LAYOUTS = {
    "PP2+VPP2": ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--nproc-per-node", "2"],
    "PP4+VPP2": ["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--nproc-per-node", "4"],
}


def mean_iteration_ms(argv: list[str]) -> float:
    done = subprocess.run([sys.executable, "-m", "mm_adaptor.cli", "train", *argv], capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"mm-adaptor train {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    found = re.search(r"mean iteration ([\d.]+) ms", done.stdout + done.stderr)
    if not found:
        raise SystemExit(f"no training summary in the output of mm-adaptor train {' '.join(argv)}")
    return float(found.group(1))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=8, help="per step (global batch / micro-batch)")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--extra", type=int, default=1, help="--vpp-extra-warmup-microbatches")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args(argv)
    model = ["--hidden-size", str(args.hidden), "--num-attention-heads", "4", "--seq-length", str(args.seq),
             "--micro-batch-size", "1", "--global-batch-size", str(args.micro_batches),
             "--num-layers-per-virtual-pipeline-stage", "1", "--train-iters", str(args.iters)]
    print(f"# hidden {args.hidden}, seq {args.seq}, {args.micro_batches} micro-batches of 1 per step, fp32, "
          f"{args.iters} iterations, mean excluding the first; --vpp-extra-warmup-microbatches {args.extra}")
    print("| layout | megatron interleaved ms | with extra warm-up ms | ratio (megatron / extra) |")
    print("|---|---|---|---|", flush=True)
    results = {}
    for name in args.layouts.split(","):
        off = mean_iteration_ms([*LAYOUTS[name], *model])
        on = mean_iteration_ms([*LAYOUTS[name], *model, "--vpp-extra-warmup", "--vpp-extra-warmup-microbatches",
                                str(args.extra)])
        results[name] = (off, on)
        print(f"| {name} | {off:.1f} | {on:.1f} | {off / on:.3f}x |", flush=True)
    return results


if __name__ == "__main__":
    main()
