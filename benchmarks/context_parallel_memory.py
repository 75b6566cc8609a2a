"""Context parallelism's activation memory: the bytes each rank saves for backward (per layer and outside the
layers, as `mm-adaptor check` reports them) when training the tiny GPT on one sequence of 8k, 16k and 32k tokens, at
CP 1 and CP N, and the ratio to the ideal 1/N.

    python benchmarks/context_parallel_memory.py [--seqs 8192 16384 32768] [--cp 2] [--algo megatron_cp_algo]

CP 1 runs with --use-flash-attn (blockwise attention, no [s, s] matrix kept), since megatron's local attention
would keep the [s, s] probabilities (32k: 16 GiB per layer) and measure that instead; CP N keeps no [s, s] either.
One iteration, one sequence per step, fp32, on the CPU backend over gloo."""

from __future__ import annotations

import argparse
import sys

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "256",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--tensor-model-parallel-size",
        "1", "--timeout", "3000"]


def saved_bytes(argv: list[str], nproc: int) -> int:
    """Rank 0's saved activation bytes (layers and outside them) of one training step."""
    from mm_adaptor.harness import runner as train

    dump = train.run(train.parse_args([*argv, "--nproc-per-node", str(nproc)]))
    per_layer = dump.memory["saved_bytes_per_layer"]
    return sum(per_layer.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--algo", default="megatron_cp_algo")
    args = parser.parse_args()
    print(f"{'seq':>6} {'CP1 MiB':>10} {f'CP{args.cp} MiB':>10} {'ratio':>7} {'ideal':>6} {'ratio / ideal':>13}",
          flush=True)
    for seq in args.seqs:
        base = saved_bytes([*TINY, "--seq-length", str(seq), "--use-flash-attn"], 1)
        split = saved_bytes([*TINY, "--seq-length", str(seq), "--context-parallel-size", str(args.cp),
                             "--context-parallel-algo", args.algo], args.cp)
        ratio = split / base
        print(f"{seq:>6} {base / 2**20:>10.2f} {split / 2**20:>10.2f} {ratio:>7.3f} {1 / args.cp:>6.3f} "
              f"{ratio * args.cp:>13.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
