"""--use-fused-gmm against unpatched Megatron: GroupedMLP on the native grouped_matmul vs SequentialMLP (what
unpatched Megatron runs without the grouped_gemm package), both started from one checkpoint; and all six fused
paths together (RMSNorm, SwiGLU, RoPE, flash attention, grouped GEMM, gradient-accumulation fusion)."""

import pytest

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

MOE = ["--num-experts", "4", "--disable-bias-linear", "--swiglu", "--moe-grouped-gemm"]
ALL_SIX = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn",
           "--use-fused-gmm", "--gradient-accumulation-fusion"]


def check(flags, layout, extra):
    result = harness.compare(flags, layout=layout, extra_args=[*MOE, *extra], iters=4)
    assert result.passed, harness.format_comparison(result)
    assert "--moe-grouped-gemm" in result.feature_args, "the baseline must run SequentialMLP"
    return result


@pytest.mark.parametrize("layout, precision", [("ep2-moe", []), ("ep2-moe", ["--bf16"]), ("tp2-sp", ["--bf16"]),
                                               ("pp2", ["--bf16"])], ids=["ep2-moe-fp32", "ep2-moe-bf16", "tp2-sp-bf16",
                                                                          "pp2-bf16"])
def test_fused_gmm_matches_sequential_experts(layout, precision):
    """Each layout in bf16, the experts' layout in fp32 too (the tighter bound); fp32 at TP2+SP: the six paths."""
    check(["--use-fused-gmm"], layout, precision)


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_all_six_fused_paths_together(precision):
    check(ALL_SIX, "tp2-sp", ["--normalization", "RMSNorm", "--position-embedding-type", "rope", *precision])

