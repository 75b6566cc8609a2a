"""FAKE torch_npu fused ops (tests only): npu_rms_norm, npu_swiglu, npu_rotary_mul and their backward ops, as
`torch.ops.npu.*` operators with torch_npu's schemas, the argument rules its documentation states, and the autograd
wiring its derivatives.yaml declares, computed by reference math in float32. NOT Ascend kernels: these numerics say
nothing about the real ones.

Source (read for the facts, nothing copied): Ascend/op-plugin at commit 517f2e7d (2026-08-21, master after tag
26.1.0): op_plugin/config/op_plugin_functions.yaml (schemas), op_plugin/config/derivatives.yaml (which backward op
each forward's gradient calls), op_plugin/ops/opapi/{RmsNorm,RmsNormBackward}KernelOpApi.cpp (rstd and dgamma are
float32; rstd keeps x's leading dims and 1 for gamma's), RotaryMulBackwardKernelNpuOpApi.cpp (x is handed to the
kernel only when r1 or r2 needs a gradient), docs/zh/custom_APIs/torch_npu/*.md (dtypes, shapes, layouts).
"""

from __future__ import annotations

import torch

from torch_npu.ops import CALLS

SCHEMAS = {
    "npu_rms_norm": "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_rms_norm_backward": "npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) "
                             "-> (Tensor, Tensor)",
    "npu_swiglu": "npu_swiglu(Tensor self, int dim=-1) -> Tensor",
    "npu_swiglu_backward": "npu_swiglu_backward(Tensor grad_output, Tensor self, int dim=-1) -> Tensor",
    "npu_rotary_mul": "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) "
                      "-> Tensor",
    "npu_rotary_mul_backward": "npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2, "
                               "str rotary_mode='half') -> (Tensor, Tensor, Tensor)",
}
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
LIB = torch.library.Library("npu", "DEF")  # noqa: TOR901 (the fake's own namespace, as torch_npu's is "npu")


def _count(name):
    CALLS[name] = CALLS.get(name, 0) + 1


def _check(ok, message):
    if not ok:
        raise RuntimeError(f"(FAKE torch_npu) {message}")


# --- npu_rms_norm ---------------------------------------------------------------------------------------------

def _rms_shapes(x, gamma):
    _check(x.dtype in FLOATS, f"npu_rms_norm: self dtype {x.dtype} is not float16, bfloat16 or float32")
    _check(gamma.dtype in (x.dtype, torch.float32), f"npu_rms_norm: gamma {gamma.dtype} with self {x.dtype}")
    _check(x.dim() >= gamma.dim(), "npu_rms_norm: the gamma shape should not be bigger than self shape")
    _check(tuple(x.shape[x.dim() - gamma.dim():]) == tuple(gamma.shape),
           f"npu_rms_norm: gamma shape {tuple(gamma.shape)} is not self's trailing shape {tuple(x.shape)}")
    lead = x.dim() - gamma.dim()
    return (*x.shape[:lead], *([1] * gamma.dim())), tuple(range(lead, x.dim()))


def rms_norm(x, gamma, epsilon=1e-6):
    _count("npu_rms_norm")
    rstd_shape, dims = _rms_shapes(x, gamma)
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon) if dims else torch.rsqrt(xf.pow(2) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd.reshape(rstd_shape)


def rms_norm_backward(dy, x, gamma, rstd):
    _count("npu_rms_norm_backward")
    rstd_shape, dims = _rms_shapes(x, gamma)
    _check(rstd.dtype == torch.float32 and tuple(rstd.shape) == tuple(rstd_shape),
           f"npu_rms_norm_backward: rstd must be float32 of shape {tuple(rstd_shape)}, got {rstd.dtype} "
           f"{tuple(rstd.shape)}")
    xf, dyf, gf = x.float(), dy.float(), gamma.float()
    xhat = xf * rstd
    lead = tuple(range(x.dim() - gamma.dim()))
    dgamma = (dyf * xhat).sum(lead) if lead else dyf * xhat
    n = gamma.numel()
    mean_dot = (dyf * gf * xhat).sum(dims, keepdim=True) / n
    return (rstd * (dyf * gf - xhat * mean_dot)).to(x.dtype), dgamma


def _rms_meta(x, gamma, epsilon=1e-6):
    rstd_shape, _ = _rms_shapes(x, gamma)
    return torch.empty_like(x), x.new_empty(rstd_shape, dtype=torch.float32)


def _rms_bwd_meta(dy, x, gamma, rstd):
    return torch.empty_like(x), gamma.new_empty(gamma.shape, dtype=torch.float32)


def _rms_setup(ctx, inputs, output):
    x, gamma, _eps = inputs
    ctx.save_for_backward(x, gamma, output[1])


def _rms_autograd(ctx, grad, _grad_rstd):
    x, gamma, rstd = ctx.saved_tensors
    dx, dgamma = torch.ops.npu.npu_rms_norm_backward(grad, x, gamma, rstd)
    return dx, dgamma.to(gamma.dtype), None


# --- npu_swiglu -----------------------------------------------------------------------------------------------

def _swiglu_check(x, dim):
    _check(x.dtype in FLOATS, f"npu_swiglu: dtype {x.dtype} is not float16, bfloat16 or float32")
    _check(1 <= x.dim() <= 8, f"npu_swiglu: {x.dim()} dims (1 to 8 supported)")
    _check(-x.dim() <= dim < x.dim(), f"npu_swiglu: dim {dim} out of range for {x.dim()} dims")
    _check(x.shape[dim] % 2 == 0, f"npu_swiglu: size {x.shape[dim]} of dim {dim} is not even")
    _check(x.is_contiguous(), "npu_swiglu: non-contiguous input is not supported")
    _check(x.numel() > 0, "npu_swiglu: empty input is not supported")


def swiglu(x, dim=-1):
    _count("npu_swiglu")
    _swiglu_check(x, dim)
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def swiglu_backward(grad_output, x, dim=-1):
    _count("npu_swiglu_backward")
    _swiglu_check(x, dim)
    a, b = x.float().chunk(2, dim=dim)
    g = grad_output.float()
    sig = torch.sigmoid(a)
    return torch.cat([g * b * sig * (1 + a * (1 - sig)), g * a * sig], dim=dim).to(x.dtype)


def _swiglu_meta(x, dim=-1):
    shape = list(x.shape)
    shape[dim] //= 2
    return x.new_empty(shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.dim = inputs[1]


def _swiglu_autograd(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.npu.npu_swiglu_backward(grad, x, ctx.dim), None


# --- npu_rotary_mul -------------------------------------------------------------------------------------------

def _rotate(x, mode):
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _rotary_check(x, r1, r2, mode, rotate=None):
    _check(mode in ("half", "interleave"), f"npu_rotary_mul: rotary_mode {mode!r} (half or interleave)")
    _check(rotate is None, "npu_rotary_mul: the FAKE implements no `rotate` matrix")
    for name, t in (("input", x), ("r1", r1), ("r2", r2)):
        _check(t.dim() in (3, 4), f"npu_rotary_mul: {name} has {t.dim()} dims (3 or 4 supported)")
        _check(t.dtype in FLOATS, f"npu_rotary_mul: {name} dtype {t.dtype}")
    d = x.shape[-1]
    _check(d % 2 == 0 and d < 896, f"npu_rotary_mul: D={d} must be even and below 896")
    _check(r1.shape == r2.shape and r1.shape[-1] == d, "npu_rotary_mul: r1 and r2 must match and end in D")
    torch.broadcast_shapes(x.shape, r1.shape)
    if mode == "interleave":  # r1, r2 as 11SD / 1S1D / S11D / T1D: one non-broadcast dim besides D
        _check(sum(s != 1 for s in r1.shape[:-1]) <= 1,
               f"npu_rotary_mul: interleave mode takes r1/r2 broadcast over all but one leading dim, got "
               f"{tuple(r1.shape)}")


def rotary_mul(x, r1, r2, rotary_mode="half", rotate=None):
    _count(f"npu_rotary_mul:{rotary_mode}")
    _rotary_check(x, r1, r2, rotary_mode, rotate)
    xf = x.float()
    return (xf * r1.float() + _rotate(xf, rotary_mode) * r2.float()).to(x.dtype)


def _reduce_to(t, shape):
    dims = tuple(i for i, (a, b) in enumerate(zip(t.shape, shape)) if b == 1 and a != 1)
    return t.sum(dims, keepdim=True) if dims else t


def _unrotate(z, mode):
    """The transpose of _rotate: sum_i g_i * rotate(x)_i = sum_j x_j * unrotate(g)_j."""
    return -_rotate(z, mode)


def rotary_mul_backward(grad, x, r1, r2, rotary_mode="half"):
    _count(f"npu_rotary_mul_backward:{rotary_mode}")
    _rotary_check(x, r1, r2, rotary_mode)
    g = grad.float()
    dx = (g * r1.float() + _unrotate(g * r2.float(), rotary_mode)).to(x.dtype)
    if r1.requires_grad or r2.requires_grad:  # op-plugin hands x to the kernel only then
        xf = x.float()
        dr1 = _reduce_to(g * xf, r1.shape).to(x.dtype)
        dr2 = _reduce_to(g * _rotate(xf, rotary_mode), r2.shape).to(x.dtype)
    else:
        dr1, dr2 = torch.zeros_like(r1, dtype=x.dtype), torch.zeros_like(r2, dtype=x.dtype)
    return dx, dr1, dr2


def _rotary_meta(x, r1, r2, rotary_mode="half", rotate=None):
    return torch.empty_like(x)


def _rotary_bwd_meta(grad, x, r1, r2, rotary_mode="half"):
    return torch.empty_like(x), torch.empty_like(r1, dtype=x.dtype), torch.empty_like(r2, dtype=x.dtype)


def _rotary_setup(ctx, inputs, output):
    x, r1, r2, mode, _rotate_matrix = inputs
    ctx.save_for_backward(x, r1, r2)
    ctx.mode = mode


def _rotary_autograd(ctx, grad):
    x, r1, r2 = ctx.saved_tensors
    dx, dr1, dr2 = torch.ops.npu.npu_rotary_mul_backward(grad, x, r1, r2, ctx.mode)
    return dx, dr1, dr2, None, None


KERNELS = {
    "npu_rms_norm": (rms_norm, _rms_meta, (_rms_autograd, _rms_setup)),
    "npu_rms_norm_backward": (rms_norm_backward, _rms_bwd_meta, None),
    "npu_swiglu": (swiglu, _swiglu_meta, (_swiglu_autograd, _swiglu_setup)),
    "npu_swiglu_backward": (swiglu_backward, lambda g, x, dim=-1: torch.empty_like(x), None),
    "npu_rotary_mul": (rotary_mul, _rotary_meta, (_rotary_autograd, _rotary_setup)),
    "npu_rotary_mul_backward": (rotary_mul_backward, _rotary_bwd_meta, None),
}


def define(lib, schemas, kernels) -> None:
    """Each op: its schema, the reference kernel for the npu device, a fake (meta) kernel and its autograd."""
    for name, (kernel, meta, autograd) in kernels.items():
        lib.define(schemas[name])
        lib.impl(name, kernel, "PrivateUse1")
        torch.library.register_fake(f"npu::{name}", meta, lib=lib)
        if autograd is not None:
            torch.library.register_autograd(f"npu::{name}", autograd[0], setup_context=autograd[1], lib=lib)


def register() -> dict:
    define(LIB, SCHEMAS, KERNELS)
    return {name: getattr(torch.ops.npu, name) for name in KERNELS}
