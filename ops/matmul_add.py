"""matmul_add_fp32: main_grad (fp32) += grad_output^T @ input, the weight-gradient GEMM without fp32 copies.
Native kernels: csrc/cpu/matmul_add.cpp (ATen GEMMs), csrc/cuda/; NPU: the reference."""

from __future__ import annotations

import torch

from mm_adaptor.ops.library import OpSpec, accumulation_dtype, ensure, op, register


def reference(main_grad, grad_output, input):
    out, inp = grad_output.shape[-1], input.shape[-1]
    acc = accumulation_dtype(grad_output)
    main_grad.add_((grad_output.reshape(-1, out).to(acc).t() @ input.reshape(-1, inp).to(acc)).to(main_grad.dtype))


def fake(main_grad, grad_output, input):
    return None


SPECS = register(
    OpSpec("matmul_add_fp32", "(Tensor(a!) main_grad, Tensor grad_output, Tensor input) -> ()", reference, fake,
           native=("cpu", "cuda")),
)


def matmul_add_fp32(main_grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    """main_grad (fp32) += grad_output^T @ input, without fp32 copies of the inputs."""
    ensure(main_grad.device.type)
    op("matmul_add_fp32")(main_grad, grad_output, input)
