"""swiglu: Megatron's convention, a, b = x.chunk(2, -1); silu(a) * b. Backward recomputes silu from x.
Native kernels: csrc/cpu/swiglu.cpp, csrc/cuda/; NPU: torch_npu.npu_swiglu forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mm_adaptor.ops.library import OpSpec, accumulation_dtype, ensure, op, register


def reference_fwd(x):
    a, b = x.to(accumulation_dtype(x)).chunk(2, dim=-1)
    return (F.silu(a) * b).to(x.dtype)


def reference_bwd(dy, x):
    a, b = x.to(accumulation_dtype(x)).chunk(2, dim=-1)
    g = dy.to(a.dtype)
    sig = torch.sigmoid(a)
    da = g * b * sig * (1 + a * (1 - sig))
    db = g * a * sig
    return torch.cat([da, db], dim=-1).to(x.dtype)


def fake_fwd(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def fake_bwd(dy, x):
    return torch.empty_like(x)


def npu_fwd(x):
    import torch_npu

    return torch_npu.npu_swiglu(x, dim=-1)


def setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])  # only the input: silu is recomputed in backward


def backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return op("swiglu_bwd")(dy.contiguous(), x)


SPECS = register(
    OpSpec("swiglu_fwd", "(Tensor x) -> Tensor", reference_fwd, fake_fwd, native=("cpu", "cuda"), npu=npu_fwd,
           backward=backward, setup_context=setup_context),
    OpSpec("swiglu_bwd", "(Tensor dy, Tensor x) -> Tensor", reference_bwd, fake_bwd, native=("cpu", "cuda")),
)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's convention: a, b = x.chunk(2, -1); silu(a) * b. Backward recomputes silu from x."""
    ensure(x.device.type)
    return op("swiglu_fwd")(x)
