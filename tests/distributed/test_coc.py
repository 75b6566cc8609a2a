"""--use-coc against unpatched Megatron, within its calibrated tolerance and in fact bit-for-bit here: TP2 with
sequence parallelism (fp32 N=2, bf16 N=4), TP2 without it (all-reduce, uneven chunks), PP2 x TP2+SP under MindSpeed's
name, TP2+SP x DP2 with the distributed
optimizer and gradient-accumulation fusion, EP2 x expert TP2 MoE; the chunked paths really ran (the
feature's call counts); chunks re-assembled in the wrong order fail the harness. The full matrix (N=2 and 4, fp32
and bf16, every layout) is in benchmarks/RESULTS.md."""

import pytest

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

# per micro-batch of the 2-layer GPT: qkv, fc1 (x2 layers) and the output layer; proj and fc2 (x2 layers)
COLUMN_CALLS, ROW_CALLS = 5, 4


def check(flags, layout, extra, nproc=None, equal=True):
    """equal: also every compared value bit for bit, which the declared tolerance does not promise but this CPU's
    GEMMs give when every chunk's GEMM has a multiple of 4 rows (true of these layouts: micro-batch 2 x TP2)."""
    result = harness.compare(flags, layout=layout, extra_args=list(extra), iters=4, nproc=nproc)
    assert result.passed, harness.format_comparison(result)
    assert not result.tolerance.exact
    if equal:
        differences = {group: verdict.largest for group, verdict in result.verdicts.items()
                       if any(verdict.largest.values())}
        assert not differences, differences
    return result.memory_on["feature_statistics"]["coc"]


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


def test_pp2_tp2_sequence_parallel_under_mindspeeds_name():
    calls = check(["--use-ascend-coc"], "pp2",
                  ["--tensor-model-parallel-size", "2", "--sequence-parallel"], nproc=4)
    assert calls["chunked row-parallel reduce-scatter calls"], calls


def test_chunks_in_the_wrong_order_fail():
    with harness.extra_feature_module("broken_coc_feature"):
        result = harness.compare(["--use-test-broken-coc"], layout="tp2-sp", extra_args=[], iters=4)
    assert not result.passed
    assert result.loss_failures


def test_tp2_sp_dp2_distributed_optimizer_with_gradient_accumulation_fusion():
    """The weight gradient goes into main_grad through megatron's fused accumulation, sharded by the optimizer."""
    calls = check(["--use-coc"], "tp2-sp", ["--bf16", "--use-distributed-optimizer", "--gradient-accumulation-fusion"],
                  nproc=4)
    column, row = calls["chunked column-parallel all-gather calls"], calls["chunked row-parallel reduce-scatter calls"]
    assert column and column * ROW_CALLS == row * COLUMN_CALLS, calls


def test_ep2_with_tensor_parallel_experts():
    """EP2 x expert TP2 (TP2+SP on 4 ranks): each expert gathers its uneven rows by chunks. The tokens an expert
    gets are not a multiple of 4, so GEMM rounding may differ: judged against the calibrated tolerance only."""
    calls = check(["--use-coc"], "ep2-moe", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                             "--disable-bias-linear"], nproc=4, equal=False)
    # 2 layers x 2 local experts x 2 micro-batches x 4 steps
    assert calls["chunked expert fc1 all-gather calls"] == calls["chunked expert fc2 reduce-scatter calls"] == 32
