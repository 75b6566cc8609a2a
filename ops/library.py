"""The `mm_adaptor` operator registry: each op module declares its ops as `OpSpec`s; this module registers their
schemas, fakes and autograd formulas, and loads per device the native kernels or the plain-PyTorch references."""

from __future__ import annotations

import functools
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from mm_adaptor.ops.builder import DISPATCH_KEYS

NAMESPACE = "mm_adaptor"
NPU_DISPATCH_KEY = "PrivateUse1"


@dataclass(frozen=True)
class OpSpec:
    """One operator and the implementation that serves each device.

    native: the devices whose native library (csrc/<device>/, csrc/common/) has a kernel for it; elsewhere, and
    where the native build is impossible, the reference runs. npu: the torch_npu implementation, None for the
    reference. cuda: a Python implementation for CUDA (torch's own fused kernels) where csrc/cuda has none.
    backward and setup_context: its autograd formula, for ops that have one.
    """

    name: str
    schema: str
    reference: Callable
    fake: Callable
    native: tuple[str, ...]
    npu: Callable | None = None
    backward: Callable | None = None
    setup_context: Callable | None = None
    cuda: Callable | None = None

    def fallback(self, device_type: str) -> Callable:
        """What serves `device_type` without a native kernel."""
        return self.cuda if device_type == "cuda" and self.cuda is not None else self.reference


SPECS: dict[str, OpSpec] = {}
_lib = torch.library.Library(NAMESPACE, "DEF")
_impl_lib = torch.library.Library(NAMESPACE, "IMPL")


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise (as the native kernels accumulate)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=None)
def npu_op_arguments(name: str) -> frozenset:
    """The argument names of torch_npu's torch.ops.npu.<name>, over all its overloads, read from their schemas
    (nothing is called): which release's form this torch_npu has."""
    packet = getattr(torch.ops.npu, name)
    return frozenset(a.name for overload in packet.overloads() for a in getattr(packet, overload)._schema.arguments)


def op(name: str):
    return getattr(torch.ops.mm_adaptor, name).default


def register(*specs: OpSpec) -> tuple[OpSpec, ...]:
    """Define each op with its fake implementation and autograd formula; kernels come with `ensure`."""
    if _device_state:
        raise RuntimeError(f"mm_adaptor ops must be registered before kernels load (already loaded: {status()})")
    for spec in specs:
        qualname = f"{NAMESPACE}::{spec.name}"
        _lib.define(spec.name + spec.schema)
        torch.library.register_fake(qualname, spec.fake)
        if spec.backward is not None:
            torch.library.register_autograd(qualname, spec.backward, setup_context=spec.setup_context)
        SPECS[spec.name] = spec
    return specs


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
        return _load_npu()
    if device_type not in DISPATCH_KEYS:
        return {"native": False, "why": f"no kernels for device type {device_type!r}"}
    from mm_adaptor.ops import builder

    key = DISPATCH_KEYS[device_type]
    try:
        result = builder.build(device_type)
    except builder.BuildUnavailable as exc:
        _impl(key, {spec.name: spec.fallback(device_type) for spec in SPECS.values()})
        warnings.warn(f"mm_adaptor native ops for {device_type}: {exc}; the plain-PyTorch references run instead "
                      "(correct, slower)", RuntimeWarning, stacklevel=3)
        return {"native": False, "why": str(exc)}
    _impl(key, {spec.name: spec.fallback(device_type) for spec in SPECS.values() if device_type not in spec.native})
    return {"native": True, "why": f"native {device_type} kernels from {result.library}", "result": result}


def _load_npu() -> dict:
    """torch_npu's fused kernels where an op has one, else its reference. Not verified on NPU hardware."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return {"native": False, "why": "torch_npu is not installed"}
    _impl(NPU_DISPATCH_KEY, {spec.name: spec.npu or spec.reference for spec in SPECS.values()})
    return {"native": True, "why": "torch_npu fused kernels (not verified on NPU hardware)"}


def _impl(key: str, kernels: dict[str, Callable]) -> None:
    for name, fn in kernels.items():
        _impl_lib.impl(name, fn, key)


def status() -> dict[str, dict]:
    return {device: {"native": s["native"], "why": s["why"]} for device, s in _device_state.items()}
