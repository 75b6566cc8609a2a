"""--balanced-moe-experts against the unbalanced run under a skewed router, at EP2 and EP4, side by side in one run:
the tiny GPT (the harness's runner), MoE layers of --experts experts, top-2, the alltoall dispatcher, fp32, on the
CPU backend over gloo, one rank per expert-parallel rank.

The skew: the router's logits get +--skew on the first --hot experts for every token (a benchmark-only patch of
megatron's Router.gating, in both runs), so most tokens go to a few experts on the first EP rank(s).

Per configuration, from every rank (a benchmark-only instrument, registered here and loaded into the ranks):
  expert rows: the rows each rank's expert MLPs compute per MoE-layer forward (megatron's experts and the hot
               copies); max / mean over the ranks, summed over the forwards (1.00 = perfect balance);
  a2a bytes:   bytes each rank sends to other ranks in the dispatcher's all-to-alls per MoE-layer forward and its
               backward (dispatch and combine, each way), the busiest rank's and the mean, averaged over forwards;
  copy bytes:  parameter bytes each rank receives in the hot experts' broadcasts per forward (backward returns as
               many as fp32 gradients to the owners); 0 unbalanced.
The losses of the two runs agree within rounding (printed).

    python benchmarks/moe_balance.py [--experts 8] [--hot 2] [--skew 0.1] [--steps 3] [--seq 256] [--ep 2 4]

The instrument's patches are not in the fingerprint table (it is no feature of the project), so its ranks run with
MM_ADAPTOR_ALLOW_CONTRACT_MISMATCH=1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

from mm_adaptor.core import features
from mm_adaptor.core.features import BIT_FOR_BIT, Feature, Flag

INSTRUMENT = "bench-moe-traffic"


class MoETraffic(Feature):
    """Benchmark-only: skews the router and counts expert rows and all-to-all bytes per MoE-layer forward."""

    name = INSTRUMENT
    description = "benchmark instrument: router skew, expert rows and all-to-all bytes per MoE forward"
    flags = (Flag("--bench-moe-traffic", description),
             Flag("--bench-moe-skew", "logit offset of the favoured experts", type=float, default=0.0),
             Flag("--bench-moe-favoured", "how many experts (the first) the skew favours", type=int, default=2))
    tolerance = BIT_FOR_BIT

    def __init__(self):
        self.rows: list[int] = []  # per MoE-layer forward on this rank
        self.sent: list[int] = []

    def statistics(self):
        return {"rows": list(self.rows), "sent": list(self.sent)}

    def patch_sets(self, options):
        from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

        skew, favoured = options.bench_moe_skew, options.bench_moe_favoured
        contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
        ps = PatchSet(self.name)

        def gating(wrapped, instance, args, kwargs):
            logits = wrapped(*args, **kwargs)
            if instance.training and torch.is_grad_enabled():
                self.rows.append(0)
                self.sent.append(0)
            bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
            bias[:favoured] = skew
            return logits + bias

        def mlp_forward(wrapped, instance, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            per_token_scale = args[1] if len(args) > 1 else kwargs.get("per_token_scale")
            if per_token_scale is not None and self.rows:  # an expert (megatron passes its probabilities)
                self.rows[-1] += int(hidden.shape[0])
            return wrapped(*args, **kwargs)

        def all_to_all_single(wrapped, instance, args, kwargs):
            import torch.distributed as dist

            inp = args[1]
            input_splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
            group = kwargs.get("group", args[4] if len(args) > 4 else None)
            me, size = dist.get_rank(group), dist.get_world_size(group)
            rows = list(input_splits) if input_splits is not None and len(input_splits) else \
                [inp.shape[0] // size] * size
            row_bytes = inp[:1].numel() * inp.element_size() if inp.shape[0] else 0
            if self.sent:  # the forward's dispatch and combine, and their backward (in the next forward's entry)
                self.sent[-1] += sum(int(r) for i, r in enumerate(rows) if i != me) * row_bytes
            return wrapped(*args, **kwargs)

        ps.wrap("megatron.core.transformer.moe.router.Router.gating", gating, contract=contract)
        ps.wrap("megatron.core.transformer.mlp.MLP.forward", mlp_forward, contract=contract)
        ps.wrap("torch.distributed.all_to_all_single", all_to_all_single,
                contract=Contract(versions=">=2.0", package="torch"))
        return [ps]


# registered once per process: a rank may hold this file both as multiprocessing's __mp_main__ and as moe_balance
if INSTRUMENT not in features._REGISTRY:
    features.register(MoETraffic)


def per_rank(dump, key):
    return [r.memory["feature_statistics"][INSTRUMENT][key] for r in dump.ranks]


def run(args, ep: int, balanced: bool):
    from mm_adaptor.harness import runner as train
    from mm_adaptor.harness.compare import checked_args

    argv = ["--num-layers", str(args.layers), "--num-experts", str(args.experts), "--expert-model-parallel-size",
            str(ep), "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear",
            "--seq-length", str(args.seq), "--train-iters", str(args.steps), "--nproc-per-node", str(ep),
            "--seed", str(args.seed), "--bench-moe-traffic", "--bench-moe-skew", str(args.skew),
            "--bench-moe-favoured", str(args.hot)]
    if balanced:
        argv += ["--balanced-moe-experts", "--balanced-moe-hot-expert-num", str(args.hot)]
    dump = train.run(checked_args(argv, check_devices=False))
    rows, sent = per_rank(dump, "rows"), per_rank(dump, "sent")
    forwards = len(rows[0])
    assert all(len(r) == forwards for r in rows), [len(r) for r in rows]
    max_rows = sum(max(r[f] for r in rows) for f in range(forwards))
    mean_rows = sum(sum(r[f] for r in rows) / ep for f in range(forwards))
    max_sent = sum(max(s[f] for s in sent) for f in range(forwards)) / forwards
    mean_sent = sum(sum(s[f] for s in sent) / ep for f in range(forwards)) / forwards
    stats = dump.ranks[0].memory["feature_statistics"].get("balanced-moe-experts", {})
    copied = 0
    if balanced:  # every rank receives each hot expert it does not own: one expert's parameters
        expert_bytes = sum(p.numel() * p.element_size() for name, p in dump.ranks[0].params.items()
                           if ".local_experts.0." in name and "layers.0." in name)
        copied = expert_bytes * args.hot * (ep - 1) / ep  # the mean rank's share of the N broadcasts
    return {"max/mean rows": max_rows / mean_rows, "max rows": max_rows / forwards, "mean rows": mean_rows / forwards,
            "max a2a": max_sent, "mean a2a": mean_sent, "copy": copied, "loss": dump.losses[-1], "stats": stats}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hot", type=int, default=2, help="N hot experts (and the skew's favoured experts)")
    parser.add_argument("--skew", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)

    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    os.environ["MM_ADAPTOR_FEATURE_MODULES"] = ",".join(
        filter(None, [os.environ.get("MM_ADAPTOR_FEATURE_MODULES"), "moe_balance"]))
    os.environ["MM_ADAPTOR_ALLOW_CONTRACT_MISMATCH"] = "1"
    sys.modules.setdefault("moe_balance", sys.modules[__name__])

    from _common import device_name, package_version

    results = defaultdict(dict)
    for ep in args.ep:
        for balanced in (False, True):
            results[ep][balanced] = run(args, ep, balanced)
    print(f"# {device_name('cpu')}, megatron-core {package_version('megatron-core')}; tiny GPT, {args.layers} MoE "
          f"layers of {args.experts} experts, top-2, alltoall, fp32, seq {args.seq}, micro-batch 2, {args.steps} "
          f"steps; router skew +{args.skew:g} on experts 0..{args.hot - 1}; N = {args.hot} hot experts; per MoE-layer "
          f"forward")
    print("| EP | run | expert rows max/mean | rows, busiest rank | rows, mean rank | a2a bytes sent, busiest rank | "
          "a2a bytes sent, mean rank | copy bytes in, mean rank | last loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ep, pair in results.items():
        for balanced, r in pair.items():
            name = f"--balanced-moe-experts N {args.hot}" if balanced else "unbalanced"
            print(f"| {ep} | {name} | {r['max/mean rows']:.2f} | {r['max rows']:.0f} | {r['mean rows']:.0f} | "
                  f"{r['max a2a']:,.0f} | {r['mean a2a']:,.0f} | {r['copy']:,.0f} | {r['loss']:.6f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
