"""rms_norm: y = x / sqrt(mean(x^2) + eps) * weight over the last dim, fp32 accumulation (fp64 for fp64).
Native kernels: csrc/cpu/rms_norm.cpp, csrc/cuda/; NPU: torch_npu.npu_rms_norm and npu_rms_norm_backward (the
reference where torch_npu documents no kernel: float64, a 1-D input, a weight dtype other than x's or float32)."""

from __future__ import annotations

import torch

from mm_adaptor.ops.library import OpSpec, accumulation_dtype, ensure, op, register


def reference_fwd(x, weight, eps):
    xf = x.to(accumulation_dtype(x))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (xf * rstd * weight.to(xf.dtype)).to(x.dtype)
    return y, rstd.reshape(-1)


def reference_bwd(dy, x, weight, rstd):
    n = x.shape[-1]
    acc = accumulation_dtype(x)
    xf, dyf, wf = x.to(acc).reshape(-1, n), dy.to(acc).reshape(-1, n), weight.to(acc)
    r = rstd.to(acc).reshape(-1, 1)
    xhat = xf * r
    dw = (dyf * xhat).sum(0)
    mean_dot = (dyf * wf * xhat).sum(-1, keepdim=True) / n
    dx = r * (dyf * wf - xhat * mean_dot)
    return dx.reshape(x.shape).to(x.dtype), dw.to(weight.dtype)


def fake_fwd(x, weight, eps):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.empty_like(x), x.new_empty((rows,), dtype=accumulation_dtype(x))


def fake_bwd(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def npu_serves(x, weight) -> bool:
    """torch_npu's npu_rms_norm: x float16/bfloat16/float32 with 2 to 8 dims, gamma of x's dtype or float32."""
    return x.dtype in NPU_DTYPES and 2 <= x.dim() <= 8 and weight.dtype in (x.dtype, torch.float32)


def npu_fwd(x, weight, eps):
    if not npu_serves(x, weight):
        return reference_fwd(x, weight, eps)
    import torch_npu

    y, rstd = torch_npu.npu_rms_norm(x, weight, epsilon=eps)  # rstd: float32, x's leading dims and a trailing 1
    return y, rstd.reshape(-1)


def npu_bwd(dy, x, weight, rstd):
    if not npu_serves(x, weight):
        return reference_bwd(dy, x, weight, rstd)
    import torch_npu

    dx, dw = torch_npu.npu_rms_norm_backward(dy, x, weight, rstd.reshape(*x.shape[:-1], 1))
    return dx, dw.to(weight.dtype)  # torch_npu's dgamma is float32


def setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = op("rms_norm_bwd")(dy.contiguous(), x, weight, rstd)
    return dx, dw, None


SPECS = register(
    OpSpec("rms_norm_fwd", "(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)", reference_fwd, fake_fwd,
           native=("cpu", "cuda"), npu=npu_fwd, backward=backward, setup_context=setup_context),
    OpSpec("rms_norm_bwd", "(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)", reference_bwd,
           fake_bwd, native=("cpu", "cuda"), npu=npu_bwd),
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, fp32 accumulation."""
    ensure(x.device.type)
    return op("rms_norm_fwd")(x, weight, float(eps))[0]
