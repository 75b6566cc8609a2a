"""--use-coc on the newest megatron-core (collected only on 0.17 or newer): it serves, the linears' and the MoE
layer's functions being core_v0.19.0's; against unpatched Megatron it is bit for bit in TP2 with sequence
parallelism (fp32 N=2, bf16 N=4) and without it (all-reduce, uneven chunks), and within the calibrated tolerance
for EP2 x expert TP2 MoE (uneven rows per expert), each time with the chunked paths counted as run; chunks
re-assembled in the wrong order (tests/distributed/broken_coc_feature.py) fail the same comparison."""

import sys
from pathlib import Path

import pytest

from mm_adaptor import harness, versions

pytestmark = pytest.mark.distributed

# the broken variant lives beside the 0.16 regression test; the training ranks import it from the same path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

# per micro-batch of the 2-layer GPT: qkv, fc1 (x2 layers) and the output layer; proj and fc2 (x2 layers)
COLUMN_CALLS, ROW_CALLS = 5, 4


def check(flags, layout, extra, nproc=None, equal=True):
    """equal: every compared value bit for bit, as this CPU's GEMMs give when each chunk's GEMM has a multiple of
    4 rows (micro-batch 2 x TP2)."""
    result = harness.compare(flags, layout=layout, extra_args=list(extra), iters=4, nproc=nproc)
    assert result.passed, harness.format_comparison(result)
    assert not result.tolerance.exact
    if equal:
        differences = {group: verdict.largest for group, verdict in result.verdicts.items()
                       if any(verdict.largest.values())}
        assert not differences, differences
    return result.memory_on["feature_statistics"]["coc"]


def test_coc_serves_on_this_release():
    state = {s.name: s for s in versions.feature_states()}["coc"]
    assert not state.refusals, state.refusals


@pytest.mark.parametrize("chunks,extra", [("2", []), ("4", ["--bf16"])], ids=["n2-fp32", "n4-bf16"])
def test_tp2_sequence_parallel(chunks, extra):
    calls = check(["--use-coc", "--coc-parallel-num", chunks], "tp2-sp", extra)
    column, row = calls["chunked column-parallel all-gather calls"], calls["chunked row-parallel reduce-scatter calls"]
    assert column and column * ROW_CALLS == row * COLUMN_CALLS, calls
    assert "chunked row-parallel all-reduce calls" not in calls


def test_tp2_all_reduce_with_uneven_chunks():
    """36 rows in 8 chunks: 4 of 5 rows, 4 of 4."""
    calls = check(["--use-coc", "--coc-parallel-num", "8"], "tp2", ["--bf16", "--seq-length", "36"])
    assert calls["chunked row-parallel all-reduce calls"] and len(calls) == 1, calls


def test_ep2_with_tensor_parallel_experts():
    """EP2 x expert TP2 (TP2+SP on 4 ranks) through 0.19's MoE layer and all-to-all dispatcher: each expert
    gathers its uneven rows by chunks; judged against the calibrated tolerance only (not multiples of 4 rows)."""
    calls = check(["--use-coc"], "ep2-moe", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                             "--disable-bias-linear"], nproc=4, equal=False)
    # 2 layers x 2 local experts x 2 micro-batches x 4 steps
    assert calls["chunked expert fc1 all-gather calls"] == calls["chunked expert fc2 reduce-scatter calls"] == 32


def test_chunks_in_the_wrong_order_fail():
    with harness.extra_feature_module("broken_coc_feature"):
        result = harness.compare(["--use-test-broken-coc"], layout="tp2-sp", extra_args=[], iters=4)
    assert not result.passed
    assert result.loss_failures
