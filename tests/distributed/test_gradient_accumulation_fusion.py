"""Megatron's --gradient-accumulation-fusion works without Apex (the adaptor provides its extension's API on the
native matmul_add_fp32) and matches the plain weight-gradient path within fp32 GEMM rounding (that the
fused path really runs is asserted in tests/unit/test_gradient_accumulation_fusion_unit.py)."""

import pytest

from mm_adaptor import harness
from mm_adaptor.features import Tolerance

pytestmark = pytest.mark.distributed

FUSED_WGRAD = Tolerance(exact=False, rtol=1e-3, atol=5e-4, low_precision_rtol=5e-2, low_precision_atol=1e-2,
                        why="the weight-gradient GEMM accumulates into main_grad instead of adding a separate "
                            "product: fp32 rounding order only (Adam may amplify it on near-zero gradients)")


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2"])
def test_gradient_accumulation_fusion_matches_the_plain_path(layout, precision):
    tolerance = FUSED_WGRAD.for_precision(bool(precision))
    result = harness.compare(["--gradient-accumulation-fusion"], layout=layout, extra_args=precision, iters=4,
                             tolerance=tolerance, require_features=False)
    assert result.passed, harness.format_comparison(result)
