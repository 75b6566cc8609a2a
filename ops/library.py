"""The `mm_adaptor` operator namespace: schemas, fake (meta) implementations, autograd formulas, and the
choice per device between the native kernels and the plain-PyTorch references."""

from __future__ import annotations

import threading
import warnings

import torch

from mm_adaptor.ops import reference as ref

NAMESPACE = "mm_adaptor"
SCHEMAS = {
    "rms_norm_fwd": "(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)",
    "rms_norm_bwd": "(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)",
    "swiglu_fwd": "(Tensor x) -> Tensor",
    "swiglu_bwd": "(Tensor dy, Tensor x) -> Tensor",
    "rotary_pos_emb_fwd": "(Tensor t, Tensor freqs, bool interleaved) -> Tensor",
    "rotary_pos_emb_bwd": "(Tensor dy, Tensor freqs, bool interleaved) -> Tensor",
    "matmul_add_fp32": "(Tensor(a!) main_grad, Tensor grad_output, Tensor input) -> ()",
    "grouped_matmul_fwd": "(Tensor x, Tensor weights, Tensor tokens_per_expert) -> Tensor",
    "grouped_matmul_bwd": "(Tensor dy, Tensor x, Tensor weights, Tensor tokens_per_expert) -> (Tensor, Tensor)",
}
REFERENCES = {
    "rms_norm_fwd": ref.rms_norm_fwd,
    "rms_norm_bwd": ref.rms_norm_bwd,
    "swiglu_fwd": ref.swiglu_fwd,
    "swiglu_bwd": ref.swiglu_bwd,
    "rotary_pos_emb_fwd": ref.rotary_pos_emb_fwd,
    "rotary_pos_emb_bwd": ref.rotary_pos_emb_bwd,
    "matmul_add_fp32": ref.matmul_add_fp32,
    "grouped_matmul_fwd": ref.grouped_matmul_fwd,
    "grouped_matmul_bwd": ref.grouped_matmul_bwd,
}

_lib = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    _lib.define(_name + _schema)
_impl_lib = torch.library.Library(NAMESPACE, "IMPL")


def op(name: str):
    return getattr(torch.ops.mm_adaptor, name).default


# ---------------------------------------------------------------- fake implementations


@torch.library.register_fake("mm_adaptor::rms_norm_fwd")
def _(x, weight, eps):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.empty_like(x), x.new_empty((rows,), dtype=acc)


@torch.library.register_fake("mm_adaptor::rms_norm_bwd")
def _(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


@torch.library.register_fake("mm_adaptor::swiglu_fwd")
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.register_fake("mm_adaptor::swiglu_bwd")
def _(dy, x):
    return torch.empty_like(x)


@torch.library.register_fake("mm_adaptor::rotary_pos_emb_fwd")
def _(t, freqs, interleaved):
    return torch.empty_like(t)


@torch.library.register_fake("mm_adaptor::rotary_pos_emb_bwd")
def _(dy, freqs, interleaved):
    return torch.empty_like(dy)


@torch.library.register_fake("mm_adaptor::matmul_add_fp32")
def _(main_grad, grad_output, input):
    return None


@torch.library.register_fake("mm_adaptor::grouped_matmul_fwd")
def _(x, weights, tokens_per_expert):
    return x.new_empty((x.shape[0], weights.shape[2]))


@torch.library.register_fake("mm_adaptor::grouped_matmul_bwd")
def _(dy, x, weights, tokens_per_expert):
    return torch.empty_like(x), torch.empty_like(weights)


# ---------------------------------------------------------------- autograd


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = op("rms_norm_bwd")(dy.contiguous(), x, weight, rstd)
    return dx, dw, None


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])  # only the input: silu is recomputed in backward


def _swiglu_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return op("swiglu_bwd")(dy.contiguous(), x)


def _rope_setup(ctx, inputs, output):
    _t, freqs, interleaved = inputs
    ctx.save_for_backward(freqs)
    ctx.interleaved = interleaved


def _rope_backward(ctx, dy):
    (freqs,) = ctx.saved_tensors
    return op("rotary_pos_emb_bwd")(dy.contiguous(), freqs, ctx.interleaved), None, None


def _gmm_setup(ctx, inputs, output):
    x, weights, counts = inputs
    ctx.save_for_backward(x, weights, counts)


def _gmm_backward(ctx, dy):
    x, weights, counts = ctx.saved_tensors
    dx, dw = op("grouped_matmul_bwd")(dy.contiguous(), x, weights, counts)
    return dx, dw, None


torch.library.register_autograd("mm_adaptor::rms_norm_fwd", _rms_backward, setup_context=_rms_setup)
torch.library.register_autograd("mm_adaptor::swiglu_fwd", _swiglu_backward, setup_context=_swiglu_setup)
torch.library.register_autograd("mm_adaptor::rotary_pos_emb_fwd", _rope_backward, setup_context=_rope_setup)
torch.library.register_autograd("mm_adaptor::grouped_matmul_fwd", _gmm_backward, setup_context=_gmm_setup)


# ---------------------------------------------------------------- per-device kernels

from mm_adaptor.ops.builder import DISPATCH_KEYS  # noqa: E402 - one table for the builder and the dispatcher
_state_lock = threading.Lock()
_device_state: dict[str, dict] = {}  # device type -> {"native": bool, "why": str}


def ensure(device_type: str) -> dict:
    """Make sure kernels for `device_type` are registered: native if it builds, else the references (one warning)."""
    state = _device_state.get(device_type)
    if state is not None:
        return state
    with _state_lock:
        if device_type in _device_state:
            return _device_state[device_type]
        state = _load(device_type)
        _device_state[device_type] = state
        return state


def _load(device_type: str) -> dict:
    if device_type == "npu":
        from mm_adaptor.ops import npu

        return npu.register(_impl_lib)
    if device_type not in DISPATCH_KEYS:
        return {"native": False, "why": f"no kernels for device type {device_type!r}"}
    from mm_adaptor.ops import builder

    try:
        result = builder.build(device_type)
        return {"native": True, "why": f"native {device_type} kernels from {result.library}", "result": result}
    except builder.BuildUnavailable as exc:
        _register_references(device_type)
        warnings.warn(f"mm_adaptor native ops for {device_type}: {exc}; the plain-PyTorch references run instead "
                      "(correct, slower)", RuntimeWarning, stacklevel=3)
        return {"native": False, "why": str(exc)}


def _register_references(device_type: str) -> None:
    key = DISPATCH_KEYS[device_type]
    for name, fn in REFERENCES.items():
        _impl_lib.impl(name, fn, key)


def status() -> dict[str, dict]:
    return {device: {"native": s["native"], "why": s["why"]} for device, s in _device_state.items()}
