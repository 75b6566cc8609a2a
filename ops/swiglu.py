"""swiglu: Megatron's convention, a, b = x.chunk(2, -1); silu(a) * b. Backward recomputes silu from x.
Native kernels: csrc/cpu/swiglu.cpp, csrc/cuda/; NPU: torch_npu.npu_swiglu and npu_swiglu_backward (the reference
for float64, which torch_npu documents no kernel for)."""

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


NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def npu_fwd(x):
    if x.dtype not in NPU_DTYPES or x.numel() == 0:
        return reference_fwd(x)
    import torch_npu

    return torch_npu.npu_swiglu(x.contiguous(), dim=-1)  # torch_npu takes no non-contiguous input


def npu_bwd(dy, x):
    if x.dtype not in NPU_DTYPES or x.numel() == 0:
        return reference_bwd(dy, x)
    import torch_npu

    return torch_npu.npu_swiglu_backward(dy.contiguous(), x.contiguous(), dim=-1)


def setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])  # only the input: silu is recomputed in backward


def backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return op("swiglu_bwd")(dy.contiguous(), x)


SPECS = register(
    OpSpec("swiglu_fwd", "(Tensor x) -> Tensor", reference_fwd, fake_fwd, native=("cpu", "cuda"), npu=npu_fwd,
           backward=backward, setup_context=setup_context),
    OpSpec("swiglu_bwd", "(Tensor dy, Tensor x) -> Tensor", reference_bwd, fake_bwd, native=("cpu", "cuda"),
           npu=npu_bwd),
)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's convention: a, b = x.chunk(2, -1); silu(a) * b. Backward recomputes silu from x."""
    ensure(x.device.type)
    return op("swiglu_fwd")(x)
