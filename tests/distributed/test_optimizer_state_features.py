"""--swap-optimizer and --virtual-optimizer against unpatched Megatron: bit-for-bit in fp32 and bf16 with the
device and host rows to the byte; checkpoints saved with either load without it and the other way round,
continuing exactly as an uninterrupted run; a swap that reuses a host buffer too early and a move to host memory
that loses the moments fail the harness, in fp32 and bf16."""

import pytest

from checkpoint_directions import assert_checkpoints_load_both_ways

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

SWAP = ["--swap-optimizer"]
VIRTUAL = ["--virtual-optimizer"]


def check(flags, layout, extra):
    result = harness.compare(flags, layout=layout, extra_args=list(extra), iters=4)
    assert result.passed, harness.format_comparison(result)
    assert result.tolerance.exact
    return result


def residences(memory, kind):
    return {r: memory["by_residence"][r][kind] for r in ("device", "host")}


@pytest.mark.parametrize("extra", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_swap_optimizer_moves_the_shards_state_to_host_memory(extra):
    """bf16: main-parameter shards and moments (12 bytes per shard element) leave the device; fp32: the moments
    (the main parameters are the model's own)."""
    result = check(SWAP, "dp2-distopt", extra)
    off, on = result.memory_off, result.memory_on
    for kind in ("optimizer_main_param_bytes", "optimizer_moment_bytes"):
        moved = kind == "optimizer_moment_bytes" or extra
        expected = {"device": 0, "host": off[kind]} if moved else residences(off, kind)
        assert residences(on, kind) == expected, kind
    assert on["parameter_bytes"] == off["parameter_bytes"] and on["gradient_bytes"] == off["gradient_bytes"]
    stats = on["feature_statistics"]["swap-optimizer"]
    assert stats["steps"] == 4
    assert stats["bytes_to_host"] == 4 * (off["optimizer_moment_bytes"] +
                                          (off["optimizer_main_param_bytes"] if extra else 0)), \
        "every step sends the whole state back"


def test_swap_optimizer_ep2_moe_bf16_with_overlapped_param_gather():
    check(SWAP, "ep2-moe", ["--bf16", "--use-distributed-optimizer", "--overlap-param-gather"])


@pytest.mark.parametrize("module,flag,layout", [
    ("broken_swap_optimizer_feature", "--use-test-swap-optimizer-reusing-buffers", "dp2-distopt"),
    ("broken_virtual_optimizer_feature", "--use-test-virtual-optimizer-losing-moments", "tp2")],
    ids=["swap-reusing-a-host-buffer-too-early", "virtual-losing-the-moments"])
@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_a_wrong_variant_fails(module, flag, layout, precision):
    """The unpatched runs are the checks' above (cached)."""
    with harness.extra_feature_module(module):
        result = harness.compare([flag], layout=layout, extra_args=precision, iters=4)
    assert not result.passed
    assert result.params.failures


@pytest.mark.parametrize("layout,extra", [("tp2", []), ("dp2-distopt", ["--bf16"])], ids=["tp2-fp32", "distopt-bf16"])
def test_virtual_optimizer_keeps_every_moment_in_host_memory(layout, extra):
    result = check(VIRTUAL, layout, extra)
    off, on = result.memory_off, result.memory_on
    assert residences(on, "optimizer_moment_bytes") == {"device": 0, "host": off["optimizer_moment_bytes"]}
    stats = on["feature_statistics"]["virtual-optimizer"]
    assert stats["moment_bytes_in_host_memory"] == off["optimizer_moment_bytes"] and stats["steps"] == 4


def test_virtual_optimizer_budget_keeps_the_rest_on_the_device():
    budget_gb = 0.0003  # 300 kB of the tp2 rank's 699 kB of moments
    result = check(["--virtual-optimizer", str(budget_gb)], "tp2", ["--bf16"])
    host = residences(result.memory_on, "optimizer_moment_bytes")
    assert 0 < host["host"] <= budget_gb * 1e9 < host["host"] + host["device"]
    assert host["host"] + host["device"] == result.memory_off["optimizer_moment_bytes"]


@pytest.mark.parametrize("flags,layout", [(SWAP, "dp2-distopt"), (VIRTUAL, "tp2")],
                         ids=["swap-optimizer", "virtual-optimizer"])
def test_checkpoints_load_both_ways(tmp_path, flags, layout):
    assert_checkpoints_load_both_ways(tmp_path, layout, flags, ["--bf16"])
