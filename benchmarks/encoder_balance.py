"""--encoder-dp-balance against the unbalanced run, side by side in one run: the tiny Qwen2.5-VL on two data-parallel
ranks and a generated skewed messages data set (most images small, a few large), micro-batches of several samples.

The ranks meet at every micro-batch (the gradients' reduction waits for the slowest), so the figure that counts is
per micro-batch: the encoder's seconds on each rank (the driver's memory["encoder_seconds"], host time per call),
summed over the micro-batches of the slowest rank each time (the critical path) against the mean rank's (perfect
balance); likewise the patches each rank encodes (max / mean per micro-batch, averaged). Also the images moved and
the last loss (equal: the balance changes no number beyond rounding).

    python benchmarks/encoder_balance.py [--samples 32] [--micro-batch 8] [--steps 3] [--layers 2]
                                         [--context-parallel-size 2]

With --context-parallel-size 2 the two ranks are context-parallel ranks of one data-parallel rank: unbalanced, each
encodes all the micro-batch's images; balanced, they share them.
"""

from __future__ import annotations

import argparse
import tempfile

from _common import device_name, package_version
from vlm_packing import make_data

# (weight, image side): most images small (4 x 4 patches), a few large (32 x 32)
MIX = ((0.85, 56), (0.15, 448))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32, help="samples per step (both ranks)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--context-parallel-size", type=int, default=1, choices=(1, 2))
    args = parser.parse_args()
    from mm_adaptor.harness import runner as train
    from mm_adaptor.harness.compare import checked_args

    with tempfile.TemporaryDirectory() as folder:
        data = make_data(folder, 4 * args.samples, args.seed, MIX)
        base = ["--model", "qwen2_5_vl-tiny", "--data-path", data, "--num-layers", str(args.layers),
                "--seq-length", "1024", "--micro-batch-size", str(args.micro_batch), "--global-batch-size",
                str(args.samples), "--train-iters", str(args.steps), "--seed", str(args.seed), "--nproc-per-node", "2",
                "--context-parallel-size", str(args.context_parallel_size)]
        rows = {}
        for name, extra in (("unbalanced", []), ("--encoder-dp-balance", ["--encoder-dp-balance"])):
            dump = train.run(checked_args([*base, *extra]))
            per_rank = [r.memory["encoder_seconds"][1:] for r in dump.ranks]  # the first call warms up
            critical = sum(max(calls) for calls in zip(*per_rank))
            ideal = sum(sum(calls) / len(calls) for calls in zip(*per_rank))
            balance = dump.ranks[0].memory.get("encoder_balance")
            patches = [a for _, a in balance["per_call"]] if balance else None
            rows[name] = (critical, ideal, patches, balance["images_moved"] if balance else 0, dump.losses[-1])
    # the unbalanced run's patches per rank: the balanced run's "before" (the same micro-batches)
    before = [b for b, _ in balance["per_call"]]
    rows["unbalanced"] = (*rows["unbalanced"][:2], before, *rows["unbalanced"][3:])
    print(f"# {device_name('cpu')}, megatron-core {package_version('megatron-core')}; tiny Qwen2.5-VL, {args.layers} "
          f"language layers, fp32, 2 {'context' if args.context_parallel_size > 1 else 'data'}-parallel ranks "
          f"(gloo), {args.samples} samples per step in micro-batches of "
          f"{args.micro_batch} ({MIX[0][0]:.0%} {MIX[0][1]}px, {MIX[1][0]:.0%} {MIX[1][1]}px images), {args.steps} "
          f"steps; encoder seconds per micro-batch: host time, the first left out")
    print("| run | encoder s, slowest rank per micro-batch | the mean rank's | slowest / mean | patches max / mean "
          "per micro-batch | images moved | last loss |")
    print("|---|---|---|---|---|---|---|")
    for name, (critical, ideal, patches, moved, loss) in rows.items():
        patches = [p for p in patches if sum(p)]  # the video exchange of an image-only batch moves nothing
        spread = sum(max(p) / (sum(p) / len(p)) for p in patches) / len(patches)
        print(f"| {name} | {critical:.3f} | {ideal:.3f} | {critical / ideal:.2f} | {spread:.2f} | {moved} | "
              f"{loss:.6f} |")


if __name__ == "__main__":
    main()
