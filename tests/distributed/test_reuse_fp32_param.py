"""--reuse-fp32-param against unpatched Megatron: bit-for-bit in TP2, PP2, DP2 with the distributed optimizer (and
--overlap-param-gather) and EP2 MoE, bf16, with the main-parameter bytes to the byte; checkpoints saved with the
feature load without it and the other way round, continuing exactly as an uninterrupted run; a split that drops
the low bits fails the harness."""

import pytest

from mm_adaptor import harness, train
from mm_adaptor.harness import LAYOUTS

pytestmark = pytest.mark.distributed

FLAG = "--reuse-fp32-param"


def check(layout, extra=()):
    result = harness.compare([FLAG], layout=layout, extra_args=["--bf16", *extra], iters=4)
    assert result.passed, harness.format_comparison(result)
    assert result.tolerance.exact
    return result


def assert_main_params_to_the_byte(result):
    """Each fp32 main element (4 bytes) is now a 2-byte residual; a word whose residual would not fit 16 bits
    is kept whole, with its index (12 bytes). Nothing else changes."""
    off, on = result.memory_off, result.memory_on
    stats = on["feature_statistics"]["reuse-fp32-param"]
    elements = stats["main_param_elements"]
    assert off["optimizer_main_param_bytes"] == 4 * elements
    assert on["optimizer_main_param_bytes"] == 2 * elements + 12 * stats["exceptions"]
    for kind in ("parameter_bytes", "gradient_bytes", "optimizer_moment_bytes"):
        assert on[kind] == off[kind], kind
    assert stats["steps"] == 4


@pytest.mark.parametrize("layout", ["tp2", "pp2", "ep2-moe"])
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


def losses(layout, extra, iters):
    args = train.parse_args([*LAYOUTS[layout], "--bf16", *extra, "--train-iters", str(iters),
                             "--nproc-per-node", "2", "--timeout", "300", "--silent"])
    return train.run(args).losses


@pytest.mark.parametrize("layout", ["tp2", "dp2-distopt"])
def test_checkpoints_load_both_ways(tmp_path, layout):
    """Saved at step 2 with and without the feature; each loaded with and without it trains steps 3-4 exactly as
    the uninterrupted unpatched run."""
    straight = losses(layout, [], 4)
    for saved_with in ([FLAG], []):
        ckpt = tmp_path / f"saved-{'with' if saved_with else 'without'}"
        assert losses(layout, [*saved_with, "--save", str(ckpt)], 2) == straight[:2]
        for loaded_with in ([FLAG], []):
            if saved_with or loaded_with:  # without both ways is the driver's own resume test
                resumed = losses(layout, [*loaded_with, "--load", str(ckpt)], 4)
                assert resumed == straight[2:], (saved_with, loaded_with, resumed, straight)
