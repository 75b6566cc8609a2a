"""Apex's `fused_weight_gradient_mlp_cuda` API on the native matmul_add_fp32, for every device.

Megatron's gradient-accumulation fusion calls `wgrad_gemm_accum_fp32(input, grad_output, main_grad)`
(main_grad += grad_output^T @ input); without Apex it refuses to run. The adaptor provides this module
under that name when Apex's extension is absent.
"""

from __future__ import annotations

import torch

from mm_adaptor import ops


def wgrad_gemm_accum_fp32(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    ops.matmul_add_fp32(main_grad, grad_output, input)


def wgrad_gemm_accum_fp16(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """Half-precision main_grad: accumulate in fp32, then add once in main_grad's dtype."""
    partial = torch.zeros(main_grad.shape, dtype=torch.float32, device=main_grad.device)
    ops.matmul_add_fp32(partial, grad_output, input)
    main_grad.add_(partial.to(main_grad.dtype))
