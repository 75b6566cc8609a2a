"""--use-fused-gmm on megatron-core 0.17+: GroupedMLP is gone and --moe-grouped-gemm builds SequentialMLP on the
local spec; the feature runs its local experts' fc1 and fc2 as one grouped_matmul each. Against unpatched
Megatron (SequentialMLP, one GEMM pair per expert), with the grouped path counted as having run on every MoE
layer, and a broken variant (wrong weight gradients) that the same check rejects."""

import pytest

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

MOE = ["--num-experts", "4", "--disable-bias-linear", "--swiglu", "--moe-grouped-gemm"]
GROUPED, LOOP, GEMMS = ("SequentialMLP forwards as grouped GEMMs", "SequentialMLP forwards on megatron's loop",
                        "grouped_matmul calls")


def check(flags, layout, extra=(), iters=3):
    result = harness.compare(flags, layout=layout, extra_args=[*MOE, *extra], iters=iters)
    assert "--moe-grouped-gemm" in result.feature_args, "the baseline must run SequentialMLP without the flag"
    return result


def grouped_ran(result, feature="fused-gmm"):
    stats = result.memory_on["feature_statistics"][feature]
    assert stats[GROUPED] > 0 and LOOP not in stats, stats
    assert stats[GEMMS] == 2 * stats[GROUPED], stats  # fc1 and fc2, one grouped GEMM each per forward
    assert result.memory_on["patch_calls"][feature][
        "megatron.core.transformer.moe.experts.SequentialMLP.forward"] == stats[GROUPED]
    return stats


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_ep2_grouped_sequential_experts_match_megatron(precision):
    result = check(["--use-fused-gmm"], "ep2-moe", precision)
    assert result.passed, harness.format_comparison(result)
    grouped_ran(result)


def test_tp2_sp_expert_tensor_parallel_grouped():
    """Experts split by tensor parallelism (megatron's explicit expert communication around bare matmuls)."""
    result = check(["--use-fused-gmm"], "tp2-sp")
    assert result.passed, harness.format_comparison(result)
    grouped_ran(result)


def test_mirrored_weight_gradients_fail():
    with harness.extra_feature_module("broken_fused_gmm_feature"):
        result = check(["--use-test-fused-gmm-mirrored-wgrad"], "ep2-moe")
    grouped_ran(result, "test-fused-gmm-mirrored-wgrad")
    assert not result.passed
    assert result.grads.failures, "mirrored weight gradients reach the gradients"
