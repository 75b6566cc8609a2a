"""Megatron's GroupedMLP (--moe-grouped-gemm) on the native grouped_matmul instead of the grouped_gemm package."""

from __future__ import annotations

import types

import torch

from mm_adaptor import ops


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """The grouped_gemm package's `ops.gmm` signature: rows of `a` grouped by batch_sizes, times b[e] (or b[e].T)."""
    return ops.grouped_matmul(a, b.transpose(1, 2) if trans_b else b, batch_sizes)


NATIVE_GROUPED_GEMM_OPS = types.SimpleNamespace(gmm=gmm)


PROBS_ON_INPUT_REFUSAL = ("--moe-apply-probs-on-input works only with --moe-router-topk 1 (megatron's GroupedMLP "
                          "refuses it too): set --moe-router-topk 1 or drop --moe-apply-probs-on-input")


def grouped_gemm_is_available() -> bool:
    return True


def grouped_mlp_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
    """GroupedMLP.forward for every dtype (megatron's asserts bf16, a limit of the grouped_gemm package); otherwise
    megatron's steps: probabilities on the input, moe_act recompute (which megatron's own forward can only run with
    Transformer Engine installed), its activation (which, like megatron's, ignores the clamp value and the GLU
    offset). fp8 plays no part in megatron's GroupedMLP either.

    Zero tokens need no special case: grouped_matmul of zero rows gives zero weight gradients."""
    config = self.config
    hidden, probs = permuted_local_hidden_states, permuted_probs
    if config.moe_apply_probs_on_input:
        if config.moe_router_topk != 1:
            from mm_adaptor.features import FeatureConfigError

            raise FeatureConfigError(PROBS_ON_INPUT_REFUSAL)
        hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
        probs = torch.ones_like(probs)
    w1 = self.weight1.view(self.num_local_experts, config.hidden_size, -1)
    w2 = self.weight2.view(self.num_local_experts, -1, config.hidden_size)
    fc1_output = gmm(hidden, w1, tokens_per_expert)
    probs = probs.unsqueeze(-1)
    if self.activation_recompute:
        from megatron.core import tensor_parallel

        # fp8=None: megatron's default (False) reads as fp8 on and reaches Transformer Engine's FP8 state, a
        # NameError without TE; GroupedMLP refuses fp8 with moe_act recompute anyway
        self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=None)
        intermediate = self.activation_checkpoint.checkpoint(self.activation_func_with_probs, fc1_output, probs)
        output = gmm(intermediate, w2, tokens_per_expert)
        self.activation_checkpoint.discard_output_and_register_recompute(output)
    else:
        output = gmm(self.activation_func_with_probs(fc1_output, probs), w2, tokens_per_expert)
    return output, None
