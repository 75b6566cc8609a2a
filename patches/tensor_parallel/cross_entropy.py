"""Vocab-parallel cross-entropy with the masked writes replaced by multiplications.

Megatron zeroes out-of-shard targets and their logits with boolean-indexed writes
(`x[mask] = 0`), which on accelerators lower to nonzero + scatter and a device-to-host sync.
Multiplying by the inverted mask gives the same values (x * 1 = x, x * 0 = 0) without either.
"""

from __future__ import annotations

import torch


def calculate_predicted_logits_by_mask_multiply(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    logits_max: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
):
    vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)

    target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
    in_shard = ~target_mask
    masked_target = (target - vocab_start_index) * in_shard

    partition_vocab_size = vocab_parallel_logits.size()[-1]
    logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
    masked_target_1d = masked_target.view(-1)
    arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
    predicted_logits_1d = logits_2d[arange_1d, masked_target_1d] * in_shard.view(-1)
    predicted_logits = predicted_logits_1d.view_as(target)

    exp_logits = vocab_parallel_logits
    torch.exp(vocab_parallel_logits, out=exp_logits)
    sum_exp_logits = exp_logits.sum(dim=-1)

    return target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits
