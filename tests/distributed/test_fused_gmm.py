"""--use-fused-gmm against unpatched Megatron: GroupedMLP on the native grouped_matmul vs SequentialMLP (what
unpatched Megatron runs without the grouped_gemm package), both started from one checkpoint; and all six fused
paths together (RMSNorm, SwiGLU, RoPE, flash attention, grouped GEMM, gradient-accumulation fusion)."""

import importlib.metadata

import pytest
from packaging.version import Version

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

MOE = ["--num-experts", "4", "--disable-bias-linear", "--swiglu", "--moe-grouped-gemm"]
ALL_SIX = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn",
           "--use-fused-gmm", "--gradient-accumulation-fusion"]
# on 0.17+ (no GroupedMLP) EP2 in fp32 and bf16 is tests/latest/test_fused_gmm_on_latest.py's; TP2+SP in bf16 is
# test_all_six_fused_paths_together[bf16]'s (every fused tolerance is x1, so fused-gmm is judged as tightly there)
GROUPED_MLP = Version(importlib.metadata.version("megatron-core")) < Version("0.17")
LAYOUTS = [*([("ep2-moe", []), ("ep2-moe", ["--bf16"])] if GROUPED_MLP else []), ("pp2", ["--bf16"])]


def check(flags, layout, extra):
    result = harness.compare(flags, layout=layout, extra_args=[*MOE, *extra], iters=4)
    assert result.passed, harness.format_comparison(result)
    assert "--moe-grouped-gemm" in result.feature_args, "the baseline must run SequentialMLP"
    return result


@pytest.mark.parametrize("layout, precision", LAYOUTS, ids=[f"{lay}-{'bf16' if p else 'fp32'}" for lay, p in LAYOUTS])
def test_fused_gmm_matches_sequential_experts(layout, precision):
    """Each layout in bf16, the experts' layout in fp32 too (the tighter bound); fp32 at TP2+SP: the six paths."""
    check(["--use-fused-gmm"], layout, precision)


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_all_six_fused_paths_together(precision):
    check(ALL_SIX, "tp2-sp", ["--normalization", "RMSNorm", "--position-embedding-type", "rope", *precision])
