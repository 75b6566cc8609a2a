"""MoE experts: the local experts on the native grouped_matmul (--use-fused-gmm) against SequentialMLP's loop.

On megatron-core 0.16 the grouped side is GroupedMLP; on 0.17+ (no GroupedMLP) it is SequentialMLP built with
--moe-grouped-gemm, whose forward the feature runs as one grouped_matmul per linear.

python benchmarks/moe_experts.py [--tokens 4096] [--hidden 1024] [--ffn 2816] [--experts 8] [--dtype float32 bfloat16]

One process, one gloo rank. Both modules hold the same weights (on 0.16 SequentialMLP's are views of GroupedMLP's,
as the harness compares them) and see the same routed tokens; the outputs are checked to agree before timing.
Forward+backward medians (torch.utils.benchmark); ratio = SequentialMLP / grouped (>1: grouped faster).
Saved activation bytes are what autograd keeps after one forward (weights excluded).
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from _common import init_single_rank, median_ms, print_table_header


def build(args, dtype):
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import experts as megatron_experts

    from mm_adaptor.harness.runner import dump_entries

    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn, moe_ffn_hidden_size=args.ffn,
        num_attention_heads=8, num_moe_experts=args.experts, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_activation_fusion=False, use_cpu_initialization=True, params_dtype=dtype,
        bf16=dtype == torch.bfloat16)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False)
    expert_submodules = submodules_of(submodules_of(submodules_of(spec).mlp).experts)
    sequential = megatron_experts.SequentialMLP(args.experts, config, expert_submodules, pg_collection=groups)
    if hasattr(megatron_experts, "GroupedMLP"):  # megatron-core 0.16
        grouped = megatron_experts.GroupedMLP(args.experts, config, pg_collection=groups)
        weights = dict(sequential.named_parameters())
        with torch.no_grad():
            for name, p, view in dump_entries(grouped):
                weights[name].copy_(view(p))
    else:  # 0.17+: the feature runs SequentialMLP's experts grouped where the config asks for --moe-grouped-gemm
        grouped = megatron_experts.SequentialMLP(args.experts, dataclasses.replace(config, moe_grouped_gemm=True),
                                                 expert_submodules, pg_collection=groups)
        grouped.load_state_dict(sequential.state_dict())
    return grouped, sequential


def submodules_of(spec):
    """A ModuleSpec's submodules; megatron-core 0.19's specs are functools.partial(cls, submodules=...)."""
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules


def saved_bytes(fn, module) -> int:
    from mm_adaptor.devices.memory import SavedTensorAccountant

    accountant = SavedTensorAccountant([module])  # no decoder layers: everything lands outside them
    with accountant.hooks():
        out = fn()
    total = accountant.bytes_per_layer().get(SavedTensorAccountant.OUTSIDE, 0)
    del out
    accountant.close()
    return total


def grouped_forwards() -> int:
    from mm_adaptor.api import feature_statistics

    stats = feature_statistics().get("fused-gmm", {})
    return stats.get("grouped_matmul calls", 0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--min-run-time", type=float, default=2.0)
    args = parser.parse_args(argv)

    import mm_adaptor

    mm_adaptor.enable(argparse.Namespace(use_fused_gmm=True, num_experts=args.experts, moe_grouped_gemm=True,
                                         disable_bias_linear=True))
    init_single_rank()
    torch.manual_seed(0)
    print_table_header(f"{args.tokens} routed tokens, hidden {args.hidden}, expert ffn {args.ffn}, "
                       f"{args.experts} experts",
                       ["dtype", "pass", "grouped (native) ms", "SequentialMLP ms", "ratio",
                        "saved activations grouped / sequential"])
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        grouped, sequential = build(args, dtype)
        counts = torch.distributions.Multinomial(args.tokens, torch.ones(args.experts)).sample().long()
        x = torch.randn(args.tokens, args.hidden, dtype=dtype, requires_grad=True)
        probs = torch.rand(args.tokens, dtype=dtype)
        grad = torch.randn(args.tokens, args.hidden, dtype=dtype)
        runs = {"grouped": lambda: grouped(x, counts, probs)[0], "sequential": lambda: sequential(x, counts, probs)[0]}
        with torch.no_grad():
            before = grouped_forwards()
            torch.testing.assert_close(runs["grouped"]().float(), runs["sequential"]().float(),
                                       **({"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}))
            # 0.16's GroupedMLP cannot run without the feature's grouped_matmul; 0.17+'s SequentialMLP could
            assert type(grouped) is not type(sequential) or grouped_forwards() > before, \
                "the grouped side ran megatron's loop, not grouped_matmul"
            fwd = {k: median_ms(f, args.min_run_time) for k, f in runs.items()}

        def fwd_bwd(f):
            def run():
                x.grad = None
                f().backward(grad)
            return run

        fb = {k: median_ms(fwd_bwd(f), args.min_run_time) for k, f in runs.items()}
        modules = {"grouped": grouped, "sequential": sequential}
        saved = {k: saved_bytes(f, modules[k]) for k, f in runs.items()}
        memory = f"{saved['grouped'] / 2**20:.1f} / {saved['sequential'] / 2**20:.1f} MiB"
        for label, table in (("fwd", fwd), ("fwd+bwd", fb)):
            print(f"| {dtype_name} | {label} | {table['grouped']:.2f} | {table['sequential']:.2f} | "
                  f"{table['sequential'] / table['grouped']:.2f}x | {memory if label == 'fwd' else ''} |", flush=True)


if __name__ == "__main__":
    main()
