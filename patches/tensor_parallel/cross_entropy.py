"""Vocab-parallel cross-entropy with Megatron's boolean-indexed writes replaced by torch.where.

Megatron zeroes out-of-shard targets and their predicted logits with `x[mask] = 0`. On CPU and CUDA PyTorch
already lowers that to masked_fill_ (no nonzero, no device-to-host sync); a backend whose index_put_ takes the
general path (nonzero + scatter) pays a sync per write, which is why MindSpeed rewrites it for Ascend NPUs.
torch.where selects the same values elementwise, non-finite logits included (a multiply by the inverted mask
would turn -inf * 0 and NaN * 0 into NaN where Megatron writes 0), so the result is bit-for-bit Megatron's.
"""

from __future__ import annotations

import torch


def calculate_predicted_logits_without_masked_writes(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    logits_max: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
):
    vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)

    target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
    masked_target = torch.where(target_mask, 0, target - vocab_start_index)

    partition_vocab_size = vocab_parallel_logits.size()[-1]
    logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
    masked_target_1d = masked_target.view(-1)
    arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
    predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
    predicted_logits = torch.where(target_mask, 0.0, predicted_logits_1d.view_as(target))

    exp_logits = vocab_parallel_logits
    torch.exp(vocab_parallel_logits, out=exp_logits)
    sum_exp_logits = exp_logits.sum(dim=-1)

    return target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits


# The first version's name (it multiplied by the inverted mask); tests/distributed/broken_ce_feature.py uses it.
calculate_predicted_logits_by_mask_multiply = calculate_predicted_logits_without_masked_writes
