"""Megatron's --gradient-accumulation-fusion works without Apex (the adaptor provides its extension's API on the
native matmul_add_fp32) and matches the plain weight-gradient path within fp32 GEMM rounding (that the
fused path really runs is asserted in tests/unit/test_gradient_accumulation_fusion_unit.py)."""

import pytest

from mm_adaptor import harness
from mm_adaptor.core.features import fused_kernel_tolerance

pytestmark = pytest.mark.distributed

FUSED_WGRAD = fused_kernel_tolerance("the weight-gradient GEMM accumulates into main_grad instead of adding a "
                                     "separate product: fp32 rounding order only")


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2"])
def test_gradient_accumulation_fusion_matches_the_plain_path(layout, precision):
    result = harness.compare(["--gradient-accumulation-fusion"], layout=layout, extra_args=precision, iters=4,
                             tolerance=FUSED_WGRAD, require_features=False)
    assert result.passed, harness.format_comparison(result)
