"""--moe-tp-extend-ep against unpatched Megatron at the same TP and EP (experts sliced over TP): TP2 x EP1 (2 ranks,
fp32) and TP2 x EP2 (4 ranks, fp32 and bf16), both dispatchers, a gated (SwiGLU) expert; expert parameters and
gradients compared whole by global expert index (harness.expert_view.assemble_experts), within the calibrated
rounding noise; megatron built the extended layout (expert TP 1, EP = TP x EP); experts assigned one rank off fail,
fp32 and bf16.
(bf16 at TP2 x EP1 and the pairs with every other feature: tests/distributed/test_feature_pairs.py.)"""

import pytest

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

FLAG = "--moe-tp-extend-ep"
TINY_MOE = ["--num-layers", "2", "--num-experts", "4", "--disable-bias-linear", "--tensor-model-parallel-size", "2",
            "--sequence-parallel"]
TP2_EP1 = TINY_MOE
TP2_EP2 = [*TINY_MOE, "--expert-model-parallel-size", "2"]


def check(extra, nproc, flags=(FLAG,)):
    return harness.compare(list(flags), extra_args=extra, iters=3, nproc=nproc)


def assert_extended(result, ep, local):
    assert result.passed, harness.format_comparison(result)
    assert not result.tolerance.exact
    stats = result.memory_on["feature_statistics"]["moe-tp-extend-ep"]
    assert stats == {"expert tensor-parallel size": 1, "expert-parallel size": ep, "local experts": local}, stats


def test_tp2_ep1_two_ranks():
    result = check(TP2_EP1, nproc=2)
    assert_extended(result, ep=2, local=2)


@pytest.mark.parametrize("extra", [["--moe-token-dispatcher-type", "alltoall"],
                                   ["--bf16", "--swiglu", "--moe-token-dispatcher-type", "allgather"]],
                         ids=["fp32-alltoall", "bf16-swiglu-allgather"])
def test_tp2_ep2_four_ranks(extra):
    result = check([*TP2_EP2, *extra], nproc=4)
    assert_extended(result, ep=4, local=1)


@pytest.mark.parametrize("extra, nproc", [(TP2_EP1, 2), ([*TP2_EP2, "--bf16", "--swiglu", "--moe-token-dispatcher-type",
                                                            "allgather"], 4)], ids=["fp32", "bf16"])
def test_experts_assigned_one_rank_off_fail(extra, nproc):
    """The unpatched runs are test_tp2_ep1_two_ranks's and test_tp2_ep2_four_ranks' bf16 one (cached)."""
    with harness.extra_feature_module("broken_moe_tp_extend_ep_feature"):
        result = check(extra, nproc=nproc, flags=["--use-test-moe-tp-extend-ep-off-by-one-rank"])
    assert not result.passed
    assert result.loss_failures and result.grads.failures, "the wrong experts' outputs reach the loss"
    stats = result.memory_on["feature_statistics"]["test-moe-tp-extend-ep-off-by-one-rank"]
    assert stats["routings one rank off"] > 0, stats
