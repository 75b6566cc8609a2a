"""--reuse-fp32-param against unpatched Megatron: bit-for-bit in TP2, DP2 with the distributed optimizer (and
--overlap-param-gather) and EP2 MoE, bf16, with the main-parameter bytes to the byte; checkpoints saved with the
feature load without it and the other way round, continuing exactly as an uninterrupted run; a split that drops
the low bits fails the harness."""

import pytest

from checkpoint_directions import assert_checkpoints_load_both_ways

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

FLAG = "--reuse-fp32-param"


def check(layout, extra=()):
    result = harness.compare([FLAG], layout=layout, extra_args=["--bf16", *extra], iters=4)
    assert result.passed, harness.format_comparison(result)
    assert result.tolerance.exact
    return result


def assert_main_params_to_the_byte(result):
    """Each fp32 main element (4 bytes) is now a 2-byte residual; a word whose residual would not fit 16 bits
    is kept whole, with its index (12 bytes), in its parameter's exception buffer (room for 64 + numel / 1024, grown
    where a split needs more), whose count is an 8-byte device counter. Nothing else changes."""
    off, on = result.memory_off, result.memory_on
    stats = on["feature_statistics"]["reuse-fp32-param"]
    elements = stats["main_param_elements"]
    assert off["optimizer_main_param_bytes"] == 4 * elements
    assert stats["exceptions"] <= stats["exception_capacity"]
    assert on["optimizer_main_param_bytes"] == \
        2 * elements + 12 * stats["exception_capacity"] + 8 * stats["main_params"]
    for kind in ("parameter_bytes", "gradient_bytes", "optimizer_moment_bytes"):
        assert on[kind] == off[kind], kind
    assert stats["steps"] == 4


@pytest.mark.parametrize("layout", ["tp2", "ep2-moe"])  # every layout: RESULTS.md, `check --layout all`
def test_bit_for_bit_with_the_bytes_predicted(layout):
    assert_main_params_to_the_byte(check(layout))


def test_distributed_optimizer_with_overlapped_param_gather():
    """The rank's shard of each parameter is split against its place in the DDP parameter buffer, which the
    all-gather sends."""
    result = check("dp2-distopt", ["--overlap-param-gather"])
    assert_main_params_to_the_byte(result)
    assert result.memory_on["feature_statistics"]["reuse-fp32-param"]["main_param_elements"] * 2 < \
        result.memory_on["parameter_bytes"], "each rank keeps main parameters for its shard only"


def test_dropping_the_low_bits_fails():
    with harness.extra_feature_module("broken_reuse_fp32_param_feature"):
        result = harness.compare(["--use-test-reuse-fp32-param-losing-low-bits"], layout="tp2",
                                 extra_args=["--bf16"], iters=4)
    assert not result.passed
    assert result.params.failures


@pytest.mark.parametrize("layout", ["tp2", "dp2-distopt"])
def test_checkpoints_load_both_ways(tmp_path, layout):
    assert_checkpoints_load_both_ways(tmp_path, layout, [FLAG], ["--bf16"])
