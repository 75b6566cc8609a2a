"""Megatron's vocab-parallel cross-entropy without and with --optimize-vocab-parallel-ce, side by side in one run.

python benchmarks/vocab_parallel_ce.py [--tokens 4096 8192] [--vocab-shard 16384 32768 65536]
    [--dtype float32 bfloat16] [--tp 8] [--rounds 4] [--min-run-time 0.5]

One process, one gloo rank (a tensor-parallel group of size 1). Targets are drawn from tp x the shard, so (tp-1)/tp of
them fall outside it, as on a rank of a TP group of that size. First the ATen ops each version of
calculate_predicted_logits runs (torch.profiler); then forward and forward+backward times of
vocab_parallel_cross_entropy, after checking that losses and gradients agree bit for bit. The two versions are timed
in alternating rounds (torch.utils.benchmark medians; the order flips every round) so that load on a shared machine
hits both; the table shows the median over rounds of each and of the per-round ratio Megatron / patched (>1: the
patch is faster). "per-token part" times calculate_predicted_logits alone at a vocab shard of 1: what is left there
is the per-token work, where the two versions differ.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter

import torch

from _common import init_single_rank, median_ms, print_table_header

FEATURE = "optimize_vocab_parallel_ce"


def patched(on: bool) -> None:
    import mm_adaptor

    mm_adaptor.disable(keep_device=True)
    if on:
        mm_adaptor.enable(**{FEATURE: True})


def aten_ops(logits, target) -> Counter:
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    logits = logits.float().clone()
    logits_max = logits.max(dim=-1)[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        VocabParallelCrossEntropy.calculate_predicted_logits(logits, target, logits_max, 0, logits.size(-1))
    return Counter(e.name for e in prof.events())


def print_ops(logits, target) -> None:
    counts = {}
    for on in (False, True):
        patched(on)
        counts[on] = aten_ops(logits, target)
    for on, label in ((False, "Megatron"), (True, "patched")):
        only = sorted(set(counts[on]) - set(counts[not on]))
        print(f"# ops only {label} runs in calculate_predicted_logits: "
              + ", ".join(f"{name} x{counts[on][name]}" for name in only))
    print(f"# aten::nonzero in either: {'yes' if any('nonzero' in n for c in counts.values() for n in c) else 'no'}")


def loss_and_grad(logits, target, grad):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    inputs = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(inputs, target)
    loss.backward(grad)
    return loss.detach(), inputs.grad


def fwd(logits, target):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    def run():
        with torch.no_grad():
            vocab_parallel_cross_entropy(logits, target)

    return run


def fwd_bwd(logits, target, grad):
    """Megatron works in place on fp32 logits (they end as the gradient), so each call starts from the previous call's
    result: the same sequence of inputs for both versions, since their results are bit-for-bit equal."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    def run():
        vocab_parallel_cross_entropy(logits.detach().requires_grad_(), target).backward(grad)

    return run


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                                              b.view(torch.int16 if b.element_size() == 2 else torch.int32))


def predicted_logits_only(logits, target):
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    logits_max = logits.max(dim=-1)[0]
    work = logits.clone()

    def run():
        work.copy_(logits)  # it works in place
        VocabParallelCrossEntropy.calculate_predicted_logits(work, target, logits_max, 0, logits.size(-1))

    return run


def alternating(make_fn, rounds: int, min_run_time: float):
    """(Megatron ms, patched ms, ratio): medians over rounds, the order flipping each round."""
    times = {False: [], True: []}
    ratios = []
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            patched(on)
            times[on].append(median_ms(make_fn(), min_run_time))
        ratios.append(times[False][-1] / times[True][-1])
    return statistics.median(times[False]), statistics.median(times[True]), statistics.median(ratios)


def row(cells, off_ms, on_ms, ratio):
    print("| " + " | ".join(map(str, cells)) + f" | {off_ms:.4g} | {on_ms:.4g} | {ratio:.3f}x |", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--vocab-shard", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--dtype", nargs="*", default=["float32", "bfloat16"], help="none: per-token rows only")
    parser.add_argument("--tp", type=int, default=8, help="targets come from tp x the shard")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--min-run-time", type=float, default=0.5)
    args = parser.parse_args(argv)
    from mm_adaptor import devices

    devices.install()
    init_single_rank()
    gen = torch.Generator().manual_seed(0)
    print_ops(torch.randn(64, 1, 128, generator=gen), torch.randint(0, 128 * args.tp, (64, 1), generator=gen))
    print_table_header(f"one rank, targets from {args.tp} x the shard, {args.rounds} alternating rounds",
                       ["dtype", "tokens", "vocab shard", "pass", "Megatron ms", "patched ms", "ratio"])
    for tokens in args.tokens:
        logits = torch.randn(tokens, 1, 1, generator=gen)
        target = torch.randint(0, args.tp, (tokens, 1), generator=gen)
        row(["float32", tokens, 1, "per-token part"],
            *alternating(lambda: predicted_logits_only(logits, target), args.rounds, args.min_run_time))
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for tokens in args.tokens:
            for shard in args.vocab_shard:
                logits = torch.randn(tokens, 1, shard, generator=gen).to(dtype)
                target = torch.randint(0, shard * args.tp, (tokens, 1), generator=gen)
                grad = torch.randn(tokens, 1, generator=gen)
                results = {}
                for on in (False, True):
                    patched(on)
                    results[on] = loss_and_grad(logits, target, grad)
                if not all(same_bits(a, b) for a, b in zip(results[False], results[True])):
                    raise SystemExit(f"patched cross-entropy differs from Megatron's: {dtype_name}, {tokens}, {shard}")
                del results
                work = logits.clone()
                row([dtype_name, tokens, shard, "fwd"],
                    *alternating(lambda: fwd(work, target), args.rounds, args.min_run_time))
                row([dtype_name, tokens, shard, "fwd+bwd"],
                    *alternating(lambda: fwd_bwd(work, target, grad), args.rounds, args.min_run_time))
    patched(False)


if __name__ == "__main__":
    main()
