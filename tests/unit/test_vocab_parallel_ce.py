"""--optimize-vocab-parallel-ce against Megatron's own code, bit for bit, with finite and non-finite logits."""

import argparse

import pytest
import torch

import mm_adaptor
from mm_adaptor.patches.tensor_parallel.cross_entropy import calculate_predicted_logits_without_masked_writes

SHARD = 32
VOCAB_START, VOCAB_END = SHARD, 2 * SHARD  # the second shard of a TP2 vocabulary: half the targets fall outside


def same_bits(a, b):
    if a.is_floating_point():
        return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


def case(kind):
    """[s=6, b=2, SHARD] fp32 logits and targets from two shards plus an ignored id; `kind` puts non-finite values
    where Megatron reads a logit it then zeroes (column 0 of rows whose target is outside [start, end)) and at
    some in-shard targets."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 2, SHARD, generator=gen)
    target = torch.randint(0, 2 * SHARD, (6, 2), generator=gen)
    target[0, 0], target[1, 1], target[2, 0], target[3, 1] = VOCAB_START + 3, 5, -100, VOCAB_START + 7
    if kind == "-inf":
        logits[1, 1, 0] = logits[2, 0, 0] = float("-inf")  # out-of-shard rows, read at masked target 0
        logits[0, 0, 3] = logits[3, 1, :5] = float("-inf")  # an in-shard target; a row with a few
    elif kind == "nan":
        logits[1, 1, 0] = logits[0, 0, 9] = float("nan")
    elif kind == "+inf":
        logits[1, 1, 0] = logits[0, 0, 3] = float("inf")
    return logits, target


KINDS = ["finite", "-inf", "nan", "+inf"]


@pytest.mark.parametrize("kind", KINDS)
def test_predicted_logits_match_megatron_bit_for_bit(kind):
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    logits, target = case(kind)
    results = []
    for fn in (VocabParallelCrossEntropy.calculate_predicted_logits, calculate_predicted_logits_without_masked_writes):
        work = logits.clone()
        logits_max = work.max(dim=-1)[0]
        results.append(fn(work, target, logits_max, VOCAB_START, VOCAB_END))
    for theirs, ours in zip(*results):
        assert same_bits(theirs, ours)
    if kind != "finite":  # what a multiply by the inverted mask would give: NaN where Megatron writes 0
        target_mask, masked_target_1d, predicted = results[0][:3]
        shifted = logits - logits.max(dim=-1, keepdim=True)[0]
        read = shifted.view(-1, SHARD)[torch.arange(12), masked_target_1d]
        multiplied = read * ~target_mask.view(-1)
        assert multiplied.isnan().any() and not predicted.view(-1)[target_mask.view(-1)].isnan().any()


@pytest.fixture
def patch_switch(single_rank_megatron):
    def switch(on):
        mm_adaptor.disable(keep_device=True)
        if on:
            mm_adaptor.enable(argparse.Namespace(optimize_vocab_parallel_ce=True))

    yield switch
    mm_adaptor.disable(keep_device=True)


@pytest.mark.parametrize("kind", KINDS)
def test_vocab_parallel_cross_entropy_forward_and_backward_match_megatron(patch_switch, kind):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits, target = case(kind)
    target = target - VOCAB_START  # one rank holds [0, SHARD): the same targets fall outside it
    grad = torch.randn(6, 2, generator=torch.Generator().manual_seed(1))
    results = []
    for on in (False, True):
        patch_switch(on)
        assert ("optimize-vocab-parallel-ce" in mm_adaptor.applied_features()) == on
        inputs = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(inputs, target)
        loss.backward(grad)
        results.append((loss.detach(), inputs.grad))
    (loss_off, grad_off), (loss_on, grad_on) = results
    assert same_bits(loss_off, loss_on) and same_bits(grad_off, grad_on)
    if kind == "-inf":
        assert loss_off[1, 1].isfinite() and loss_off[2, 0].isfinite()  # the masked writes keep these finite
