"""What megatron-core 0.17-0.19 changed under the adaptor's own code and compatibility sets, checked on whichever
megatron-core is installed (each test stands in for the other version where it needs to)."""

import argparse

import pytest
import torch

from mm_adaptor.versions import contracts
from mm_adaptor.devices import megatron_compat


def installed(monkeypatch, version):
    monkeypatch.setattr(contracts, "installed_version", lambda package=contracts.MEGATRON_CORE: version)


def test_moe_router_set_stands_aside_where_megatron_defines_te_general_gemm(monkeypatch):
    monkeypatch.setattr(megatron_compat, "_transformer_engine_importable", lambda: False)
    installed(monkeypatch, "0.19.2")
    patch_set = megatron_compat.moe_router_without_te_patches()
    assert not len(patch_set) and "te_general_gemm itself" in patch_set.not_needed
    installed(monkeypatch, "0.16.1")
    patch_set = megatron_compat.moe_router_without_te_patches()
    assert patch_set.targets() == ["megatron.core.transformer.moe.moe_utils.te_general_gemm"]


def test_the_installed_router_reads_a_defined_te_general_gemm():
    from megatron.core.transformer.moe import moe_utils

    from mm_adaptor import devices

    devices.install("cpu")
    try:
        assert moe_utils.te_general_gemm is None
    finally:
        devices.uninstall()


def without_grouped_mlp(monkeypatch):
    from megatron.core.transformer.moe import experts

    monkeypatch.delattr(experts, "GroupedMLP", raising=False)  # megatron-core 0.17 removed it


def test_the_parameter_dump_works_without_grouped_mlp(monkeypatch):
    from mm_adaptor.harness.runner.dump import dump_entries

    without_grouped_mlp(monkeypatch)
    assert [name for name, _, _ in dump_entries(torch.nn.Linear(2, 3))] == ["weight", "bias"]


def test_recompute_activation_marks_layers_without_grouped_mlp(monkeypatch):
    from mm_adaptor.patches.transformer import recompute_activation as rc

    without_grouped_mlp(monkeypatch)
    layer = torch.nn.Module()
    layer.experts = torch.nn.Linear(2, 2)  # neither SequentialMLP nor (gone) GroupedMLP
    assert rc.mark_mlp(layer) == 0


@pytest.mark.parametrize("mla_rotary_interleaved", [True, None])
def test_fused_rope_leaves_mla_interleaving_to_megatron(monkeypatch, mla_rotary_interleaved):
    """0.19's apply_rotary_pos_emb(..., mla_rotary_interleaved=True) de-interleaves (MLA) even for a non-MLA config;
    None reads config.multi_latent_attention; the native kernel does neither."""
    from megatron.core.transformer import TransformerConfig

    from mm_adaptor.patches.transformer import fused_ops
    from mm_adaptor.patches.transformer.fused_ops import apply_rotary_pos_emb_fused

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    t, freqs = torch.randn(5, 2, 2, 8), torch.randn(5, 1, 1, 8)
    calls = []

    def megatron(*args, **kwargs):
        calls.append(kwargs)
        return t

    monkeypatch.setattr(fused_ops, "_warned", set())
    with pytest.warns(RuntimeWarning, match="mla_rotary_interleaved"):
        apply_rotary_pos_emb_fused(megatron, None, (t, freqs, config),
                                   {"mla_rotary_interleaved": mla_rotary_interleaved})
    apply_rotary_pos_emb_fused(megatron, None, (t, freqs, config, None, 1.0, None, mla_rotary_interleaved), {})
    assert len(calls) == 2


def test_fused_swiglu_patches_grouped_mlp_only_where_megatron_has_it(monkeypatch):
    from mm_adaptor.core import features
    feature = features.get("fused-swiglu")
    targets = [t for ps in feature.patch_sets(argparse.Namespace(swiglu=True)) for t in ps.targets()]
    from megatron.core.transformer.moe import experts

    assert ("megatron.core.transformer.moe.experts.GroupedMLP.__init__" in targets) == hasattr(experts, "GroupedMLP")
    without_grouped_mlp(monkeypatch)
    targets = [t for ps in feature.patch_sets(argparse.Namespace(swiglu=True)) for t in ps.targets()]
    assert targets == ["megatron.core.transformer.mlp.MLP.forward"]


VERIFIED_0_19 = {"vpp-extra-warmup", "recompute-activation-function", "swap-attention", "fused-rotary-pos-emb",
                 "fused-swiglu", "fused-rmsnorm", "fused-gmm", "coc", "reuse-fp32-param", "swap-optimizer",
                 "virtual-optimizer", "context-parallel", "moe-zero-memory", "balanced-moe-experts",
                 "moe-alltoall-overlap-comm", "moe-permutation-async-comm", "moe-tp-extend-ep", "compat:torch-norm",
                 "compat:torch-adam-distributed-checkpoint",
                 "device:cpu:megatron-training",  # pretrain_gpt.py from core_v0.19.0 trains on the CPU
                 "device:npu:megatron-training",  # ... and on the FAKE npu
                 "trainer:megatron-training",  # the trainer's patches (tests/train, on 0.19.2)
                 "compat:dataset-helpers-prebuilt"}  # megatron's dataset helpers without compiling them


def test_what_passed_its_checks_on_0_19_serves_0_19_code_and_nothing_else_does(monkeypatch):
    """What passed its checks on 0.19.2 (whose targets have core_v0.19.0's code: tests/latest, benchmarks/RESULTS.md)
    serves there; the one changed set never verified there (the MoE router fix, which stands aside from 0.17 since
    megatron defines te_general_gemm itself) refuses if asked."""
    from mm_adaptor.versions.fingerprint_table import FINGERPRINTS
    from mm_adaptor.versions.serving import registered_megatron_patches

    assert {name for name, versions in contracts.VERIFIED_ON.items() if "0.19.0" in versions} == VERIFIED_0_19
    monkeypatch.setattr(contracts, "live_fingerprint", lambda target: FINGERPRINTS[target]["0.19.0"])
    changed = {(p.owner, p.target) for p in registered_megatron_patches([])
               if FINGERPRINTS.get(p.target, {}).get("0.19.0") not in (None, FINGERPRINTS[p.target].get("0.16.1"))}
    assert {"coc", "reuse-fp32-param", "fused-rmsnorm"} <= {owner for owner, _ in changed}
    for owner, target in changed:
        problem = contracts.megatron_problem(owner, target, "0.19.2")
        assert (problem is None) == (owner in VERIFIED_0_19), (owner, problem)
