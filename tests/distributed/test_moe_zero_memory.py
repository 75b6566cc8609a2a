"""--moe-zero-memory against unpatched Megatron, bit-for-bit: level0 at EP2 (allgather dispatcher, bf16), level1 at
EP2 (alltoall), EP2 x TP2 and EP4 (4 ranks), and under PP2 with several micro-batches in flight (the dispatcher's
state of the micro-batch that dispatches again); the saved-activation bytes per MoE layer drop by the docs' formula
to the byte; a re-dispatched input one ulp off fails the harness, in fp32 and bf16."""

import pytest

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

FLAG = "--moe-zero-memory"
SEQ, MICRO_BATCH, HIDDEN = 64, 2, 64  # the driver's defaults
TOKENS = SEQ * MICRO_BATCH
SWIGLU_FFN = 192  # the driver's 8/3 x hidden, rounded up to a multiple of 64
# topk = number of experts: each of the 2 local experts sees every token of both EP ranks, so the bytes are known
LOCAL_EXPERTS, EXPERT_TOKENS = 2, 2 * TOKENS
EVERY_EXPERT = ["--swiglu", "--moe-router-topk", "4"]


def expected_drop(level, element_size, rows=LOCAL_EXPERTS * EXPERT_TOKENS):
    """Bytes an MoE layer no longer keeps (docs/features/moe-zero-memory.md): the experts' input (rows x hidden),
    the activation's output with what megatron's unfused GLU and the probability scale keep besides it (4 x rows x
    ffn), and at level1 fc1's output (rows x 2 ffn)."""
    kept = rows * HIDDEN + 4 * rows * SWIGLU_FFN + (rows * 2 * SWIGLU_FFN if level == "level1" else 0)
    return kept * element_size


def check(level, extra, layout="ep2-moe", nproc=None, tuning=()):
    result = harness.compare([FLAG, level, *tuning], layout=layout, extra_args=extra, iters=3, nproc=nproc)
    assert result.passed, harness.format_comparison(result)
    assert result.tolerance.exact
    stats = result.memory_on["feature_statistics"]["moe-zero-memory"]
    assert stats["experts' inputs dispatched again"] > 0 and stats["saved expert inputs released"] > 0, stats
    return result


def drops(result):
    off, on = result.memory_off["saved_bytes_per_layer"], result.memory_on["saved_bytes_per_layer"]
    return {layer: off[layer] - on[layer] for layer in off if layer.startswith("layer")}


def test_level0_ep2_allgather_bf16():
    result = check("level0", [*EVERY_EXPERT, "--bf16"])
    want = expected_drop("level0", 2)
    assert drops(result) == {"layer 1": want, "layer 2": want}


def test_level1_ep2_alltoall():
    result = check("level1", [*EVERY_EXPERT, "--moe-token-dispatcher-type", "alltoall"])
    want = expected_drop("level1", 4)
    assert drops(result) == {"layer 1": want, "layer 2": want}


def test_level1_in_the_first_layer_level0_in_the_second():
    result = check("level1", EVERY_EXPERT, tuning=["--moe-zero-memory-num-layers", "1"])
    assert drops(result) == {"layer 1": expected_drop("level1", 4), "layer 2": expected_drop("level0", 4)}


def test_level0_beside_grouped_gemms_on_fused_gmm():
    """--moe-grouped-gemm on --use-fused-gmm in both runs: the grouped GEMM keeps the experts' input, released here
    as SequentialMLP's is; the activation kept as recompute-activation-function's test counts it (0.16's GroupedMLP
    keeps its fused activation's output alone)."""
    import importlib.metadata

    from packaging.version import Version

    result = check("level0", [*EVERY_EXPERT, "--disable-bias-linear", "--moe-grouped-gemm", "--use-fused-gmm"])
    rows = LOCAL_EXPERTS * EXPERT_TOKENS
    kept = 1 if Version(importlib.metadata.version("megatron-core")) < Version("0.17") else 4
    want = (rows * HIDDEN + kept * rows * SWIGLU_FFN) * 4
    assert drops(result) == {"layer 1": want, "layer 2": want}


TOP2_ALLTOALL = ["--swiglu", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
                 "--disable-bias-linear", "--num-layers", "2", "--num-experts", "4"]


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     "--expert-model-parallel-size", "2"],
                                    ["--expert-model-parallel-size", "4"]], ids=["ep2-tp2", "ep4"])
def test_level1_on_four_ranks(layout):
    result = check("level1", [*TOP2_ALLTOALL, *layout], layout=None, nproc=4)
    assert all(drop > 0 for drop in drops(result).values()), drops(result)


def test_level1_pp2_dispatches_each_micro_batch_with_its_own_state():
    """1F1B: stage 1's second micro-batch dispatches before the first one's backward dispatches it again."""
    result = check("level1", [*TOP2_ALLTOALL, "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"],
                   layout=None, nproc=2)
    assert all(drop > 0 for drop in drops(result).values()), drops(result)


@pytest.mark.parametrize("precision", [["--moe-token-dispatcher-type", "alltoall"], ["--bf16"]], ids=["fp32", "bf16"])
def test_a_re_dispatched_input_one_ulp_off_fails(precision):
    """The unpatched runs are test_level1_ep2_alltoall's and test_level0_ep2_allgather_bf16's (cached); one ulp is
    of the input's own dtype."""
    with harness.extra_feature_module("broken_moe_zero_memory_feature"):
        result = harness.compare(["--use-test-moe-zero-memory-one-ulp-off"], layout="ep2-moe",
                                 extra_args=[*EVERY_EXPERT, *precision], iters=3)
    assert not result.passed
    assert result.grads.failures, "the wrong input reaches the experts' weight gradients"
    stats = result.memory_on["feature_statistics"]["test-moe-zero-memory-one-ulp-off"]
    assert stats["experts' inputs dispatched again"] > 0, stats
