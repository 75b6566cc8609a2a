"""--balanced-moe-experts against unpatched Megatron within the calibrated rounding noise: EP2 with the alltoall
(fp32) and allgather (bf16, every layer recomputed) dispatchers, grouped GEMMs (megatron-core 0.17+), a hot set kept
over several forwards, and on 4 ranks EP4 and EP2 x TP2 (+SP, expert TP 1); the hot experts were copied, their tokens
computed off their owners and the gradients returned. A variant whose owners drop the returned gradients fails
(fp32, bf16). Beside pipeline parallelism: the pair matrix (tests/distributed/test_feature_pairs.py)."""

import pytest

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

FLAG = "--balanced-moe-experts"
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
FOUR_RANKS = ["--moe-router-topk", "2", "--disable-bias-linear", "--num-layers", "2", "--num-experts", "4",
              *ALLTOALL]


def check(extra, hot=1, layout="ep2-moe", nproc=None, tuning=(), forwards_per_backward=1):
    result = harness.compare([FLAG, "--balanced-moe-hot-expert-num", str(hot), *tuning], layout=layout,
                             extra_args=extra, iters=3, nproc=nproc)
    assert result.passed, harness.format_comparison(result)
    assert not result.tolerance.exact
    stats = result.memory_on["feature_statistics"]["balanced-moe-experts"]
    # rank 0's: it took part in every hot expert's broadcast and reduce; the group's rows off the dispatch > 0
    transfers = stats.get("hot experts sent", 0) + stats.get("hot experts copied in", 0)
    returns = stats.get("hot expert gradients returned", 0) + stats.get("hot expert gradients sent", 0)
    assert transfers > 0 and transfers % hot == 0 and forwards_per_backward * returns == transfers, stats
    assert stats["rows computed locally"] > 0 and stats["rows kept off the dispatch (EP group)"] > 0, stats
    return result, stats


def test_ep2_alltoall_fp32():
    check(ALLTOALL, hot=2)


def test_ep2_allgather_bf16_fully_recomputed():
    """A recomputed forward takes the hot experts again from the same counts (K 1: every forward chooses): their
    weights go out twice per step, their gradients come back once."""
    check(["--bf16", *FULL_RECOMPUTE], hot=1, forwards_per_backward=2)


def test_ep2_grouped_gemm_and_a_hot_set_kept_for_two_forwards():
    """--moe-grouped-gemm: megatron-core 0.17+'s SequentialMLP (0.16's GroupedMLP is refused); K 2 chooses on every
    other forward (2 micro-batches per step here)."""
    import importlib.metadata

    from packaging.version import Version

    grouped = ["--moe-grouped-gemm", "--disable-bias-linear"] \
        if Version(importlib.metadata.version("megatron-core")) >= Version("0.17") else []
    _, stats = check([*ALLTOALL, *grouped, "--global-batch-size", "8"], hot=1,
                     tuning=["--balanced-moe-update-interval", "2"])
    transfers = stats.get("hot experts sent", 0) + stats.get("hot experts copied in", 0)
    assert transfers == 2 * stats["selections"], stats  # two forwards on each choice


@pytest.mark.parametrize("layout", [["--expert-model-parallel-size", "4"],
                                    ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]],
                         ids=["ep4", "ep2-tp2"])
def test_four_ranks(layout):
    check([*FOUR_RANKS, *layout], hot=2, layout=None, nproc=4)


@pytest.mark.parametrize("precision", [ALLTOALL, ["--bf16", *FULL_RECOMPUTE]], ids=["fp32", "bf16"])
def test_a_hot_experts_gradient_not_returned_fails(precision):
    """The unpatched runs are test_ep2_alltoall_fp32's and test_ep2_allgather_bf16_fully_recomputed's (cached)."""
    with harness.extra_feature_module("broken_balanced_moe_feature"):
        result = harness.compare(["--use-test-balanced-moe-gradient-not-returned"], layout="ep2-moe",
                                 extra_args=precision, iters=3)
    assert not result.passed
    assert result.grads.failures, "the owner's gradient of a hot expert misses the copies' part"
    stats = result.memory_on["feature_statistics"]["test-balanced-moe-gradient-not-returned"]
    assert stats["rows computed locally"] > 0, stats
