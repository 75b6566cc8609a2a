"""--use-flash-attn with --reset-attention-mask: Megatron-LM's per-document masks (built here by megatron.core's own
GPT data set function and collated as its data loader does) are read as their documents, anything else is not, and
the varlen op on those documents computes what megatron's DotProductAttention computes with the whole mask."""

import argparse
import warnings

import pytest
import torch
from torch.utils.data import default_collate

import mm_adaptor
from mm_adaptor.patches.transformer import document_masks, fused_ops

from gloo_rank import one_gloo_rank

EOD = 0
ROWS = {  # EOD positions per row of 12 tokens -> the documents' lengths
    "two-eods": ((3, 7), [4, 4, 4]),
    "no-eod": ((), [12]),
    "eod-last": ((11,), [12]),
    "eods-in-a-row": ((0, 1, 2, 9), [1, 1, 1, 7, 2]),
}


def megatron_masks(eods_per_row, s=12):
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    samples = []
    for eods in eods_per_row:
        tokens = torch.arange(1, s + 1)
        tokens[list(eods)] = EOD
        mask, _, _ = _get_ltor_masks_and_position_ids(tokens, EOD, True, True, False, True)
        samples.append({"attention_mask": mask})
    return default_collate(samples)["attention_mask"]


@pytest.mark.parametrize("rows_per_comparison", [1024, 5])
def test_megatrons_document_masks_are_read_as_their_documents(monkeypatch, rows_per_comparison):
    monkeypatch.setattr(document_masks, "ROWS_PER_COMPARISON", rows_per_comparison)
    masks = megatron_masks([eods for eods, _ in ROWS.values()])
    assert masks.dtype == torch.bool and masks.shape == (4, 1, 12, 12)
    assert document_masks.document_lengths(masks) == [lengths for _, lengths in ROWS.values()]


def not_per_document():
    base = megatron_masks([(3, 7)])
    inside = base.clone()
    inside[0, 0, 6, 5] = True  # a key of the query's own document masked
    across = base.clone()
    across[0, 0, 9, 2] = False  # a key of an earlier document visible
    future = base.clone()
    future[0, 0, 1, 2] = False  # a later key visible
    padding = torch.zeros(1, 1, 12, 12, dtype=torch.bool)
    padding[..., -2:] = True
    return {"inside": inside, "across": across, "future": future, "padding": padding}


@pytest.mark.parametrize("name", ["inside", "across", "future", "padding"])
def test_a_mask_that_is_not_per_document_is_not_read_as_documents(name):
    assert document_masks.document_lengths(not_per_document()[name]) is None


def test_each_mask_is_read_once_and_others_go_whole_after_one_warning(monkeypatch):
    reads = []
    real = document_masks.document_lengths
    monkeypatch.setattr(document_masks, "document_lengths", lambda mask: reads.append(1) or real(mask))
    documents = document_masks.DocumentAttention()
    mask = megatron_masks([(3, 7), (5,)])
    for _ in range(3):  # the layers of one forward
        found = documents.segments(mask, 2, 12, 12)
    assert found.bounds == [0, 4, 8, 12, 18, 24] and found.longest == 6 and len(reads) == 1
    assert found.cu_seqlens.device.type == "cpu"  # no layer reads the device for the bounds
    mask[0, 0, 6, 5] = True  # changed in place: read again, and no longer per document
    with pytest.warns(RuntimeWarning, match="not a per-document causal mask") as caught:
        assert documents.segments(mask, 2, 12, 12) is None
        assert documents.segments(not_per_document()["across"], 2, 12, 12) is None
    assert len(reads) == 3 and len(caught) == 1
    broadcast = megatron_masks([(3, 7)])  # one mask row for the whole batch
    assert documents.segments(broadcast, 3, 12, 12).bounds == [0, 4, 8, 12, 16, 20, 24, 28, 32, 36]
    assert documents.segments(broadcast.float(), 3, 12, 12) is None  # not boolean
    assert documents.segments(broadcast, 3, 12, 11) is None  # sq != sk


@pytest.fixture(scope="module")
def megatron_rank():
    with one_gloo_rank():
        yield


CASES = {  # config overrides, input dtype, tolerance
    "fp32": (dict(), torch.float32, dict(rtol=1e-5, atol=1e-5)),
    "fp32-gqa": (dict(num_query_groups=2), torch.float32, dict(rtol=1e-5, atol=1e-5)),
    "bf16": (dict(bf16=True, params_dtype=torch.bfloat16), torch.bfloat16, dict(rtol=2e-2, atol=2e-2)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_varlen_op_on_the_documents_equals_megatrons_masked_softmax(megatron_rank, monkeypatch, case):
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    overrides, dtype, tolerance = case
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False, **overrides)
    attn = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    gen = torch.Generator().manual_seed(7)
    groups = cfg.num_query_groups or cfg.num_attention_heads
    shapes = ((12, 3, 4, 8), (12, 3, groups, 8), (12, 3, groups, 8))
    qkv = [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]
    mask = megatron_masks([ROWS["two-eods"][0], ROWS["eods-in-a-row"][0], ROWS["no-eod"][0]])
    dy = torch.randn(12, 3, 32, generator=gen).to(dtype)

    def run():
        inputs = [t.clone().requires_grad_() for t in qkv]
        out = attn(*inputs, mask)
        out.backward(dy)
        return [out.detach(), *(t.grad for t in inputs)]

    megatron = run()
    flash_calls = []
    monkeypatch.setattr(fused_ops.ops, "flash_attention", lambda *a, **kw: flash_calls.append(kw))
    monkeypatch.setattr(document_masks, "DOCUMENTS", document_masks.DocumentAttention())
    mm_adaptor.enable(argparse.Namespace(use_flash_attn=True, reset_attention_mask=True))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            ours = run()
    finally:
        mm_adaptor.disable(keep_device=True)
    assert document_masks.DOCUMENTS.calls == 1 and not flash_calls, "the varlen op ran, the whole-mask kernel did not"
    assert document_masks.DOCUMENTS.last_cu_seqlens == [0, 4, 8, 12, 13, 14, 15, 22, 24, 36]
    for got, want in zip(ours, megatron):
        torch.testing.assert_close(got, want, **tolerance)


def test_the_drivers_document_rows_are_megatrons():
    """--reset-attention-mask --reset-position-ids: the driver's GPT rows hold several documents ended by EOD, with
    positions restarting after each EOD and the mask of exactly those documents; the same rows in every layout."""
    from mm_adaptor.harness.runner.arguments import parse_args
    from mm_adaptor.train.data import MockBatches

    args = parse_args(["--seq-length", "64", "--micro-batch-size", "2", "--reset-attention-mask",
                       "--reset-position-ids"])
    args.num_microbatches, args.data_parallel_size, args.global_batch_size = 1, 1, 2
    batch = next(MockBatches(args, dp_rank=0))
    assert batch["attention_mask"].shape == (2, 1, 64, 64) and batch["tokens"].shape == (2, 64)
    for row, (tokens, positions) in enumerate(zip(batch["tokens"], batch["position_ids"])):
        ends = (tokens == args.vocab_size - 1).nonzero().flatten().tolist()
        assert len(ends) >= 2, ends
        bounds = [0, *(e + 1 for e in ends if e + 1 < 64), 64]
        assert document_masks.document_lengths(batch["attention_mask"][row:row + 1]) == [
            [b - a for a, b in zip(bounds, bounds[1:])]]
        assert positions.tolist() == [i - a for a, b in zip(bounds, bounds[1:]) for i in range(a, b)]
    other_rank = MockBatches(args, dp_rank=1)  # DP2's second rank holds the global batch's rows 2 and 3
    args.data_parallel_size, args.global_batch_size = 2, 4
    assert not torch.equal(next(other_rank)["tokens"], batch["tokens"])
