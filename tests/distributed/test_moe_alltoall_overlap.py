"""--moe-alltoall-overlap-comm against unpatched Megatron, bit for bit: EP2 (fp32, bf16, one chunk, two chunks of two
experts), EP2 x TP2 (expert TP2 under sequence parallelism, 4 ranks) and EP4 (4 ranks); each run counts its
asynchronous all-to-alls forward and backward and the expert chunks computed with another chunk's all-to-all in
flight. A chunk whose rows go to the wrong expert fails the harness, fp32 and bf16. (The driver has no shared-experts
flag: benchmarks/moe_overlap.py checks a layer with shared experts bit for bit, and its smoke run in
tests/unit/test_benchmarks_run.py runs that check.)
--moe-permutation-async-comm: a recorded no-op on the CPU, bit for bit beside the overlap (the EP2 fp32 run)."""

import pytest

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

FLAG = "--moe-alltoall-overlap-comm"
A2A = ["--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear", "--moe-router-topk", "2"]


def check(extra, layout="ep2-moe", nproc=None, tuning=(), chunks=None):
    result = harness.compare([FLAG, *tuning], layout=layout, extra_args=extra, iters=3, nproc=nproc)
    assert result.passed, harness.format_comparison(result)
    assert result.tolerance.exact
    statistics = result.memory_on["feature_statistics"]
    stats = {**statistics["moe-alltoall-overlap-comm"], "beside": statistics}
    for kind in ("dispatch", "combine"):
        assert stats[f"{kind} all-to-alls issued async"] > 0, stats
        assert stats[f"backward {kind} all-to-alls issued async"] > 0, stats
    if chunks != 1:
        assert stats["expert chunks computed with another chunk's all-to-all in flight"] > 0, stats
    return stats


def test_ep2_fp32_beside_the_permutation_on_a_side_stream():
    stats = check(A2A, tuning=["--moe-permutation-async-comm"])
    # every forward issues one dispatch and one combine per chunk
    assert stats["dispatch all-to-alls issued async"] == stats["combine all-to-alls issued async"], stats
    side = stats["beside"]["moe-permutation-async-comm"]
    assert side["side streams"] == "none on cpu: a no-op", side


def test_ep2_bf16():
    check([*A2A, "--bf16"])


def test_ep2_one_chunk():
    check(A2A, tuning=["--moe-alltoall-overlap-chunks", "1"], chunks=1)


def test_ep2_two_chunks_of_two_experts():
    check([*A2A, "--num-experts", "8"], tuning=["--moe-alltoall-overlap-chunks", "2"])


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     "--expert-model-parallel-size", "2", "--num-experts", "4"],
                                    ["--expert-model-parallel-size", "4", "--num-experts", "8"]],
                         ids=["ep2-tp2", "ep4"])
def test_four_ranks(layout):
    check([*A2A, "--num-layers", "2", *layout], layout=None, nproc=4)


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_a_chunk_sent_to_the_wrong_expert_fails(precision):
    """The unpatched runs are test_ep2_fp32_beside_the_permutation_on_a_side_stream's and test_ep2_bf16's (cached)."""
    with harness.extra_feature_module("broken_moe_overlap_feature"):
        result = harness.compare(["--use-test-moe-overlap-wrong-expert"], layout="ep2-moe",
                                 extra_args=[*A2A, *precision], iters=3)
    assert not result.passed
    stats = result.memory_on["feature_statistics"]["test-moe-overlap-wrong-expert"]
    assert stats["dispatch all-to-alls issued async"] > 0, stats
