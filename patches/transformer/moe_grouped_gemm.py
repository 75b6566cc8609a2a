"""Megatron's GroupedMLP (--moe-grouped-gemm) on the native grouped_matmul instead of the grouped_gemm package."""

from __future__ import annotations

import types

import torch

from mm_adaptor import ops


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """The grouped_gemm package's `ops.gmm` signature: rows of `a` grouped by batch_sizes, times b[e] (or b[e].T)."""
    return ops.grouped_matmul(a, b.transpose(1, 2) if trans_b else b, batch_sizes)


NATIVE_GROUPED_GEMM_OPS = types.SimpleNamespace(gmm=gmm)


def grouped_gemm_is_available() -> bool:
    return True


def grouped_mlp_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
    """GroupedMLP.forward for every dtype (megatron's asserts bf16, a limit of the grouped_gemm package).

    Zero tokens need no special case: grouped_matmul of zero rows gives zero weight gradients."""
    config = self.config
    hidden, probs = permuted_local_hidden_states, permuted_probs
    if config.moe_apply_probs_on_input:
        if config.moe_router_topk != 1:
            raise ValueError("moe_apply_probs_on_input only works with moe_router_topk=1")
        hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
        probs = torch.ones_like(probs)
    w1 = self.weight1.view(self.num_local_experts, config.hidden_size, -1)
    w2 = self.weight2.view(self.num_local_experts, -1, config.hidden_size)
    fc1_output = gmm(hidden, w1, tokens_per_expert)
    probs = probs.unsqueeze(-1)
    if self.activation_recompute:
        from megatron.core import tensor_parallel

        self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput()
        intermediate = self.activation_checkpoint.checkpoint(self.activation_func_with_probs, fc1_output, probs)
        output = gmm(intermediate, w2, tokens_per_expert)
        self.activation_checkpoint.discard_output_and_register_recompute(output)
    else:
        output = gmm(self.activation_func_with_probs(fc1_output, probs), w2, tokens_per_expert)
    return output, None
