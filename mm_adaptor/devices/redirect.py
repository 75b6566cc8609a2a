"""The one interception layer that moves megatron's CUDA assumptions to another device; the CPU and NPU backends
configure it (a `Target`), neither copies it.

What it maps, for every torch call made while its mode is on:
- device arguments naming CUDA ('cuda', 'cuda:N', torch.device('cuda', N), an int index) to the target device;
- `Tensor.cuda()` to the target (the CPU: the tensor itself), `Tensor.is_cuda` to "is on the target" (NPU);
- `Tensor.type()` answers with the CUDA type names megatron compares against, and `.type('torch.cuda.X')` converts;
- on the CPU, `pin_memory()`/`record_stream()` become no-ops (nothing to pin, no streams);
- backward passes started inside a backward keep the mode (see `_backward_keeping_mode`).
Besides the mode: megatron's CUDA RNG-state helpers, and process-group requests naming NCCL.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet, bound_arguments

CUDA_TYPE_NAMES = ("FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor", "CharTensor",
                   "ShortTensor", "IntTensor", "LongTensor", "BoolTensor")
_DTYPE_OF_CUDA_TYPE = {
    "torch.cuda.FloatTensor": torch.float32, "torch.cuda.DoubleTensor": torch.float64,
    "torch.cuda.HalfTensor": torch.float16, "torch.cuda.BFloat16Tensor": torch.bfloat16,
    "torch.cuda.ByteTensor": torch.uint8, "torch.cuda.CharTensor": torch.int8, "torch.cuda.ShortTensor": torch.int16,
    "torch.cuda.IntTensor": torch.int32, "torch.cuda.LongTensor": torch.int64, "torch.cuda.BoolTensor": torch.bool,
}


def names_cuda(dev) -> bool:
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return isinstance(dev, int) and not isinstance(dev, bool)


@dataclass
class Target:
    """Where CUDA requests go: `type` is 'cpu' or 'npu'; `current_index` gives the device of an unindexed 'cuda'."""

    type: str
    current_index: Callable[[], int] = lambda: 0
    host_only: bool = False  # the CPU: no pinning, no streams, no device indices
    specials: dict = field(default_factory=dict)  # extra per-function handlers (func -> handler(func, args, kwargs))
    calls: dict = field(default_factory=dict)  # what was mapped, counted by kind (tests assert the mode ran)

    def device(self, dev) -> torch.device:
        self.calls["device"] = self.calls.get("device", 0) + 1
        if self.host_only:
            return torch.device("cpu")
        if isinstance(dev, int):
            return torch.device(self.type, dev)
        if isinstance(dev, str):
            dev = torch.device(dev)
        return torch.device(self.type, self.current_index() if dev.index is None else dev.index)

    def type_prefix(self) -> str:
        return "torch." if self.host_only else f"torch.{self.type}."

    def as_cuda_type_name(self, name: str) -> str:
        prefix = self.type_prefix()
        short = name[len(prefix):] if name.startswith(prefix) else None
        return f"torch.cuda.{short}" if short in CUDA_TYPE_NAMES else name


def _tensor_to(target, func, args, kwargs):
    if len(args) > 1 and names_cuda(args[1]):
        args = (args[0], target.device(args[1]), *args[2:])
    if names_cuda(kwargs.get("device")):
        kwargs["device"] = target.device(kwargs["device"])
    return func(*args, **kwargs)


def _tensor_type(target, func, args, kwargs):
    if len(args) == 1 and not kwargs:
        return target.as_cuda_type_name(func(*args))
    dtype = args[1] if len(args) > 1 else kwargs.pop("dtype", None)
    if isinstance(dtype, str) and dtype in _DTYPE_OF_CUDA_TYPE:
        return args[0].to(_DTYPE_OF_CUDA_TYPE[dtype])
    return func(args[0], dtype, **kwargs)


def _device_ctor(target, func, args, kwargs):
    if args and names_cuda(args[0]) and not isinstance(args[0], int):
        index = args[1] if len(args) > 1 else kwargs.get("index")
        dev = torch.device(args[0]) if index is None else index
        return target.device(dev)
    return func(*args, **kwargs)


def _tensor_cuda(target, func, args, kwargs):
    if target.host_only:
        return args[0]
    dev = args[1] if len(args) > 1 else kwargs.get("device")
    return args[0].to(target.device(torch.device("cuda") if dev is None else dev))


def _is_cuda(target, func, args, kwargs):
    return args[0].device.type == target.type


def _returns_self(target, func, args, kwargs):
    return args[0]


def _returns_none(target, func, args, kwargs):
    return None


_BACKWARD_ARGUMENTS = {
    torch.autograd.backward: ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs"),
    torch.Tensor.backward: ("tensors", "grad_tensors", "retain_graph", "create_graph", "inputs"),
}


def _backward_keeping_mode(mode, func, args, kwargs):
    """A mode is off while it handles a call, and the autograd engine runs a graph under the modes active when it
    starts: a backward started through dispatch (megatron's activation recompute calls torch.autograd.backward
    inside its own backward) would run without this one. So the engine is started directly with the mode on, as
    megatron's custom_backward does; unusual arguments keep torch's own path."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    bound = bound_arguments(_BACKWARD_ARGUMENTS[func], args, kwargs)
    if "gradient" in bound:
        bound["grad_tensors"] = bound.pop("gradient")
    tensors, inputs = bound.get("tensors"), bound.get("inputs")
    plain = lambda x: isinstance(x, torch.Tensor) or (  # noqa: E731
        isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x))
    if bound.get("grad_variables") is not None or not plain(tensors) or (inputs is not None and not plain(inputs)):
        return func(*args, **kwargs)
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(bound.get("grad_tensors"), len(tensors)),
                        is_grads_batched=False)
    create_graph = bool(bound.get("create_graph", False))
    retain_graph = bound.get("retain_graph")
    with mode:
        _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                             inputs, allow_unreachable=True, accumulate_grad=True)


def _handlers(target: Target) -> dict:
    handlers = {
        torch.device: _device_ctor,
        torch.Tensor.to: _tensor_to,
        torch.Tensor.type: _tensor_type,
        torch.Tensor.cuda: _tensor_cuda,
    }
    if target.host_only:
        handlers.update({torch.Tensor.pin_memory: _returns_self, torch.Tensor.record_stream: _returns_none})
    else:
        handlers[torch.Tensor.is_cuda.__get__] = _is_cuda
    return handlers


class RedirectMode(TorchFunctionMode):
    """Maps CUDA device arguments to `target` for every torch call made while installed."""

    def __init__(self, target: Target):
        super().__init__()
        self.target = target
        self._handlers = _handlers(target)
        self._specials = dict(target.specials)

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func in _BACKWARD_ARGUMENTS:
            return _backward_keeping_mode(self, func, args, kwargs)
        special = self._specials.get(func)
        if special is not None:
            return special(func, args, kwargs)
        handler = self._handlers.get(func)
        if handler is not None:
            return handler(self.target, func, args, kwargs)
        if kwargs:
            device = kwargs.get("device")
            if device is not None and names_cuda(device):
                kwargs["device"] = self.target.device(device)
            if self.target.host_only and kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def distinct(obj, target: str, owner: str):
    """A separate function object per target: torch._dynamo keys its rules by object identity."""
    if isinstance(obj, types.FunctionType):
        fn = types.FunctionType(obj.__code__, obj.__globals__, target.rsplit(".", 1)[-1], obj.__defaults__,
                                obj.__closure__)
        fn.__kwdefaults__ = obj.__kwdefaults__
        fn.__qualname__ = f"{owner}.{target}"
        return fn
    return obj


def rng_state_patches(ps: PatchSet, get_state: Callable, set_state: Callable, where: str) -> None:
    """megatron's _get_cuda_rng_state/_set_cuda_rng_state read and write `where`'s generator directly (megatron's
    own setter queues a torch.cuda lazy call, which never runs without CUDA)."""

    def get_rng_state(device="cuda", clone=False, graph_safe=False):
        if graph_safe:
            raise RuntimeError(f"CUDA-graph-safe RNG state is not available on {where}")
        return get_state()

    def set_rng_state(new_state, device=-1, graph_safe=False):
        if graph_safe:
            raise RuntimeError(f"CUDA-graph-safe RNG state is not available on {where}")
        set_state(new_state)

    contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
    ps.replace("megatron.core.tensor_parallel.random._get_cuda_rng_state", get_rng_state, contract=contract)
    ps.replace("megatron.core.tensor_parallel.random._set_cuda_rng_state", set_rng_state, contract=contract)


def names_nccl(backend) -> bool:
    return backend is not None and "nccl" in str(backend).lower()


def process_group_request(args, kwargs, to_backend: str):
    """init_process_group's arguments with NCCL renamed `to_backend` and NCCL-only options dropped."""
    if args:
        kwargs["backend"], args = args[0], args[1:]
    requested = kwargs.get("backend")
    kwargs["backend"] = to_backend if names_nccl(requested) or requested is None else requested
    kwargs.pop("device_id", None)  # the group connects lazily, on its first collective
    if names_nccl(requested):
        kwargs.pop("pg_options", None)
    return requested, args, kwargs


def new_group_request(args, kwargs, to_backend: str):
    """new_group's arguments with NCCL renamed `to_backend` and its NCCL options (pg_options) dropped."""
    requested = args[2] if len(args) >= 3 else kwargs.get("backend")
    mapped = to_backend if names_nccl(requested) else requested
    if len(args) >= 3:
        args = list(args)
        args[2] = mapped
        if len(args) >= 4:
            args[3] = None
    if "backend" in kwargs:
        kwargs["backend"] = mapped
    if kwargs.get("pg_options") is not None and (names_nccl(requested) or mapped in (None, "gloo")):
        kwargs["pg_options"] = None
    return requested, tuple(args), kwargs


class Redirection:
    """A backend's redirection while it is active: its environment defaults set, its RedirectMode entered; both
    undone exactly on exit (the CPU and NPU backends share this)."""

    def __init__(self, target: Target, env: dict[str, str]):
        self._target, self._env = target, env
        self._mode: RedirectMode | None = None
        self._saved_env: dict[str, str | None] = {}

    def enter(self) -> None:
        self._saved_env = {k: os.environ.get(k) for k in self._env}
        for key, value in self._env.items():
            os.environ.setdefault(key, value)
        self._mode = RedirectMode(self._target)
        self._mode.__enter__()

    def exit(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
