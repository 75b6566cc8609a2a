"""--vpp-extra-warmup against megatron's interleaved schedule, bit-for-bit: PP2+VPP2 (fp32, bf16, K = 1 and 3), PP4+VPP2
on 4 ranks, PP2+VPP2 x DP2 with --overlap-grad-reduce and the distributed optimizer; the stage really held K more
micro-batches (the schedule's own count); an extra warm-up on one stage only (the stages then disagree on which
transfer carries which micro-batch) fails the harness."""

import pytest

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

FLAG = ["--vpp-extra-warmup"]


def megatron_warmup(pp, vpp, rank, group=None):
    """Megatron's warm-up forwards on a stage of the interleaved schedule (group: micro-batches per virtual stage)."""
    return 2 * (pp - rank - 1) + (vpp - 1) * (group or pp)


def check(flags, layout, extra=(), nproc=None):
    result = harness.compare(flags, layout=layout, extra_args=list(extra), iters=4, nproc=nproc)
    assert result.passed, harness.format_comparison(result)
    assert result.tolerance.exact
    return result.memory_on["feature_statistics"]["vpp-extra-warmup"]


@pytest.mark.parametrize("k,extra", [(1, []), (3, ["--bf16"])], ids=["k1-fp32", "k3-bf16"])
def test_pp2_vpp2(k, extra):
    """Rank 0 (whose statistics the harness reports) holds its warm-up plus K plus the one in steady state, at most
    all 8 virtual micro-batches (4 micro-batches x 2 chunks); and it ran its passes in the order mm-adaptor schedule
    simulates, so the simulator cannot drift from what runs."""
    from mm_adaptor.cli.schedule import stage_order

    stats = check([*FLAG, "--vpp-extra-warmup-microbatches", str(k)], "pp2-vpp2", extra)
    assert stats["peak micro-batches in flight"] == min(megatron_warmup(2, 2, 0) + k + 1, 8)
    assert stats["schedules extended"] == 4
    simulated = [["F", op.chunk, op.microbatch] if op.kind == "F" else ["B"] for op in stage_order(2, 2, 4, 0, k)]
    assert stats["first step's passes"] == simulated


def test_pp4_vpp2_on_four_ranks():
    stats = check(FLAG, "pp2-vpp2", ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
                                     "--global-batch-size", "16"], nproc=4)
    assert stats["peak micro-batches in flight"] == megatron_warmup(4, 2, 0) + 1 + 1


def test_pp2_vpp2_dp2_overlapped_grad_reduce_distributed_optimizer():
    """4 micro-batches per data-parallel rank, as in test_pp2_vpp2: the same extended warm-up."""
    stats = check(FLAG, "pp2-vpp2", ["--global-batch-size", "16", "--use-distributed-optimizer",
                                     "--overlap-grad-reduce"], nproc=4)
    assert stats["peak micro-batches in flight"] == megatron_warmup(2, 2, 0) + 1 + 1
    assert stats["schedules extended"] == 4


def test_extra_warmup_on_one_stage_only_fails():
    with harness.extra_feature_module("broken_vpp_extra_warmup_feature"):
        result = harness.compare(["--use-test-broken-vpp-extra-warmup"], layout="pp2-vpp2", iters=4)
    assert not result.passed
    assert result.loss_failures
