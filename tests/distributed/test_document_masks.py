"""Megatron-LM's --reset-attention-mask through the varlen op: with --use-flash-attn the driver's document rows
(megatron.core's GPT data set builds their per-document masks and restarted positions) train within the flash
kernel's tolerance of unpatched Megatron, which computes the whole [s, s] scores and masks them; the varlen op
served the masks (its calls and the last row's document bounds are counted). A mask read with one document boundary
one token late must fail."""

import pytest

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

DOCUMENTS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
             "--micro-batch-size", "2", "--reset-attention-mask", "--reset-position-ids"]
LAYOUTS = {
    "tp2-sp-rope-gqa": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--position-embedding-type",
                        "rope", "--group-query-attention", "--num-query-groups", "2"],
    "pp2-learned": ["--pipeline-model-parallel-size", "2"],
}


def compare(layout, *flags):
    return harness.compare(["--use-flash-attn", *flags], extra_args=[*DOCUMENTS, *LAYOUTS[layout]], nproc=2, iters=2)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_document_masks_through_the_varlen_op_equal_megatron(layout):
    result = compare(layout)
    assert result.passed, harness.format_comparison(result)
    ran = result.memory_on["document_attention"]
    # two layers (one per stage at PP2), two micro-batches per step, two steps; every row holds several documents
    assert ran["calls"] >= 4, ran
    bounds = ran["last_cu_seqlens"]
    assert bounds[-1] == 2 * 64 and 64 in bounds and len(bounds) > 4, bounds


def test_a_document_boundary_read_one_token_late_fails():
    with harness.extra_feature_module("broken_packing_features"):
        result = compare("tp2-sp-rope-gqa", "--use-test-documents-one-token-late")
    assert not result.passed, harness.format_comparison(result)
    assert result.memory_on["document_attention"]["calls"] > 0
