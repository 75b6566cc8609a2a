"""--vpp-extra-warmup on the CPU: wall-clock per training step of megatron's interleaved schedule with and without
the extra warm-up, PP2+VPP2 (2 gloo ranks) and PP4+VPP2 (4 gloo ranks), one configuration after the other in one
run, each a fresh `mm-adaptor train` (Megatron-LM's loop); the mean of Megatron's iteration times, the first excluded.
Then `mm-adaptor schedule`'s prediction for the same runs, fed with the forward and backward time per model chunk
that the feature measured in the run (first stage), and the peak micro-batches the first stage held."""

from __future__ import annotations

import argparse

from _common import train_as_a_user

LAYOUTS = {
    "PP2+VPP2": ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--nproc-per-node", "2"],
    "PP4+VPP2": ["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--nproc-per-node", "4"],
}


# The same in both runs and outside the timed steps: Megatron's fusions compile at start (seconds to minutes on a
# CPU), its evaluation runs after training, loader workers start with the ranks.
OUTSIDE_THE_STEPS = ["--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--eval-iters", "0", "--num-workers", "0"]


def mean_iteration_ms(argv: list[str], fork: bool = False) -> float:
    return train_as_a_user([*argv, *OUTSIDE_THE_STEPS], timeout=1800, fork=fork)["iteration_ms"]


def measured_chunk_costs(argv: list[str]) -> dict:
    """The feature's statistics from one more run with it (rank 0, the first stage)."""
    from mm_adaptor.harness import runner as train

    dump = train.run(train.parse_args([*argv, "--timeout", "600"]))
    return dump.memory["feature_statistics"]["vpp-extra-warmup"]


def predicted_ms(layout: list[str], microbatches: int, stats: dict, extra: int, transfer_ms: float) -> tuple:
    from mm_adaptor.cli import schedule
    pp = int(layout[layout.index("--pipeline-model-parallel-size") + 1])
    costs = schedule.Costs(stats["mean forward ms per chunk"] / 1e3, stats["mean backward ms per chunk"] / 1e3,
                           latency=transfer_ms / 1e3)
    plain = schedule.simulate(pp, 2, microbatches, costs)
    more = schedule.simulate(pp, 2, microbatches, costs, extra=extra)
    return plain.step * 1e3, more.step * 1e3, plain.peak_in_flight[0], more.peak_in_flight[0]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=8, help="per step (global batch / micro-batch)")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--extra", type=int, default=1, help="--vpp-extra-warmup-microbatches")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--start", choices=["spawn", "fork"], default="spawn",
                        help="how each `mm-adaptor train` process starts: fork shares this process's imports")
    parser.add_argument("--transfer-ms", type=float, default=0.6,
                        help="one point-to-point transfer for the prediction (gloo between local ranks: about 0.35 ms "
                             "of latency plus the hidden states at about 1 GB/s, benchmarks/coc_overlap.py)")
    args = parser.parse_args(argv)
    model = ["--hidden-size", str(args.hidden), "--num-attention-heads", "4", "--seq-length", str(args.seq),
             "--micro-batch-size", "1", "--global-batch-size", str(args.micro_batches),
             "--num-layers-per-virtual-pipeline-stage", "1", "--train-iters", str(args.iters)]
    print(f"# hidden {args.hidden}, seq {args.seq}, {args.micro_batches} micro-batches of 1 per step, fp32, "
          f"{args.iters} iterations, mean excluding the first; --vpp-extra-warmup-microbatches {args.extra}")
    print("| layout | megatron interleaved ms | with extra warm-up ms | ratio (megatron / extra) | predicted ms "
          "(megatron / extra) | first stage's peak micro-batches held (predicted / observed) |")
    print("|---|---|---|---|---|---|", flush=True)
    results = {}
    for name in args.layouts.split(","):
        with_feature = [*LAYOUTS[name], *model, "--vpp-extra-warmup", "--vpp-extra-warmup-microbatches",
                        str(args.extra)]
        fork = args.start == "fork"
        off, on = mean_iteration_ms([*LAYOUTS[name], *model], fork), mean_iteration_ms(with_feature, fork)
        stats = measured_chunk_costs(with_feature)
        plain_ms, extra_ms, plain_peak, extra_peak = predicted_ms(LAYOUTS[name], args.micro_batches, stats, args.extra,
                                                                  args.transfer_ms)
        results[name] = (off, on, plain_ms, extra_ms, extra_peak, stats["peak micro-batches in flight"])
        print(f"| {name} | {off:.1f} | {on:.1f} | {off / on:.3f}x | {plain_ms:.1f} / {extra_ms:.1f} | "
              f"{plain_peak} and {extra_peak} / {stats['peak micro-batches in flight']} |", flush=True)
    if results:
        print(f"# the prediction's chunk times were measured with: {stats['chunk times measured with']}")
    return results


if __name__ == "__main__":
    main()
