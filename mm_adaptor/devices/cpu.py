"""CPU backend: megatron-core's CUDA assumptions redirected to the CPU, NCCL to gloo.

What it changes, and nothing more:
- `torch.cuda` calls megatron makes (current device, RNG state, streams, events, synchronize,
  memory statistics, device properties, nvtx) get CPU equivalents; `torch.cuda.is_available()`
  stays False so torch's own internals keep their CPU paths.
- A torch function mode maps device arguments naming CUDA ('cuda', 'cuda:N', ints,
  torch.device('cuda')) to the CPU, makes `Tensor.cuda()`/`pin_memory()`/`record_stream()`
  no-ops and lets `Tensor.type()` answer with the CUDA type names megatron compares against.
- NCCL process groups become gloo, when the CPU was chosen on purpose (MM_ADAPTOR_DEVICE=cpu or
  devices.install("cpu")) or the default group is already gloo. Chosen only because no accelerator was
  found, an NCCL default group is refused with NoAcceleratorError: a GPU node whose driver is broken
  must not train on its host CPUs without a word.
- Megatron's CUDA RNG-state helpers use the CPU generator (what dropout on the CPU draws from), and
  MoE's split sizes, already on the host, honour as_numpy.
- Megatron-LM's "Megatron requires CUDA" check is lifted.
- Asynchronous sends take a copy of their tensor (megatron frees a pipeline output while its send may still be
  reading it, which gloo's background thread does not tolerate).
- gloo's missing collectives for uneven sizes (list all_gather, list reduce_scatter), which megatron's MoE uses
  under expert tensor parallelism, run as padded tensor collectives.
"""

from __future__ import annotations

import contextlib
import os
import time
import types

import torch
from torch.overrides import TorchFunctionMode

from mm_adaptor.devices.base import DeviceBackend, NoAcceleratorError
from mm_adaptor.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

CPU = torch.device("cpu")
CPU_ONLY = "the CPU backend only"


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return isinstance(dev, int) and not isinstance(dev, bool)


_CPU_TYPE_TO_CUDA = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.CharTensor": "torch.cuda.CharTensor",
    "torch.ShortTensor": "torch.cuda.ShortTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}
_CUDA_TYPE_TO_CPU = {v: k for k, v in _CPU_TYPE_TO_CUDA.items()}


def _tensor_to(func, args, kwargs):
    if len(args) > 1 and _is_cuda_device(args[1]):
        args = (args[0], CPU, *args[2:])
    if _is_cuda_device(kwargs.get("device")):
        kwargs["device"] = CPU
    return func(*args, **kwargs)


def _tensor_type(func, args, kwargs):
    if len(args) == 1 and not kwargs:
        name = func(*args)
        return _CPU_TYPE_TO_CUDA.get(name, name)
    dtype = args[1] if len(args) > 1 else kwargs.pop("dtype", None)
    if isinstance(dtype, str):
        dtype = _CUDA_TYPE_TO_CPU.get(dtype, dtype)
    return func(args[0], dtype, **kwargs)


def _device_ctor(func, args, kwargs):
    if args and _is_cuda_device(args[0]) and not isinstance(args[0], int):
        return CPU
    return func(*args, **kwargs)


def _returns_self(func, args, kwargs):
    return args[0]


def _returns_none(func, args, kwargs):
    return None


class _Completed:
    """The work handle of a collective that already ran."""

    @staticmethod
    def wait(timeout=None):
        return True

    @staticmethod
    def is_completed():
        return True


def _on_gloo(group) -> bool:
    import torch.distributed as dist

    return dist.get_backend(group) == "gloo"


def _all_gather_uneven(func, args, kwargs):
    """gloo's all_gather takes equal sizes only; megatron's MoE gathers uneven ones (expert tensor parallelism):
    each rank's part is padded to the widest, gathered in one all_gather_into_tensor and cut back."""
    import torch.distributed as dist

    bound = dict(zip(("tensor_list", "tensor", "group", "async_op"), args), **kwargs)
    outputs, tensor, group = bound["tensor_list"], bound["tensor"], bound.get("group")
    if all(out.shape == tensor.shape for out in outputs) or not _on_gloo(group):
        return func(*args, **kwargs)
    widest = max(out.shape[0] for out in outputs)
    padded = tensor.new_zeros((widest, *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    gathered = tensor.new_empty((len(outputs) * widest, *tensor.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    for rank, out in enumerate(outputs):
        out.copy_(gathered[rank * widest:rank * widest + out.shape[0]])
    return _Completed() if bound.get("async_op") else None


def _reduce_scatter_list(func, args, kwargs):
    """gloo has no list reduce_scatter (megatron's MoE uses it for uneven sizes): the parts are padded to the
    widest and reduce-scattered as one tensor."""
    import torch.distributed as dist

    bound = dict(zip(("output", "input_list", "op", "group", "async_op"), args), **kwargs)
    output, parts, group = bound["output"], bound["input_list"], bound.get("group")
    if not _on_gloo(group):
        return func(*args, **kwargs)
    widest = max(part.shape[0] for part in parts)
    padded = output.new_zeros((len(parts) * widest, *output.shape[1:]))
    for rank, part in enumerate(parts):
        padded[rank * widest:rank * widest + part.shape[0]] = part
    mine = output.new_empty((widest, *output.shape[1:]))
    dist.reduce_scatter_tensor(mine, padded, op=bound.get("op", dist.ReduceOp.SUM), group=group)
    output.copy_(mine[:output.shape[0]])
    return _Completed() if bound.get("async_op") else None


def _isend_a_copy(func, args, kwargs):
    """An asynchronous gloo send reads its tensor from a background thread until its work completes, but megatron
    frees a pipeline output right after issuing its send (deallocate_output_tensor swaps the storage out, which
    NCCL's stream ordering tolerates): the send gets a copy of its own."""
    if args:
        args = (args[0].detach().clone(), *args[1:])
    else:
        kwargs = dict(kwargs, tensor=kwargs["tensor"].detach().clone())
    return func(*args, **kwargs)


_SPECIAL = {
    torch.distributed.isend: _isend_a_copy,
    torch.distributed.all_gather: _all_gather_uneven,
    torch.distributed.reduce_scatter: _reduce_scatter_list,
    torch.device: _device_ctor,
    torch.Tensor.to: _tensor_to,
    torch.Tensor.type: _tensor_type,
    torch.Tensor.cuda: _returns_self,
    torch.Tensor.pin_memory: _returns_self,
    torch.Tensor.record_stream: _returns_none,
}


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

    bound = dict(zip(_BACKWARD_ARGUMENTS[func], args))
    bound.update(kwargs)
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


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments to the CPU for every torch call made while installed."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func in _BACKWARD_ARGUMENTS:
            return _backward_keeping_mode(self, func, args, kwargs)
        special = _SPECIAL.get(func)
        if special is not None:
            return special(func, args, kwargs)
        if kwargs:
            device = kwargs.get("device")
            if device is not None and _is_cuda_device(device):
                kwargs["device"] = CPU
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class CpuStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered."""

    device = CPU
    cuda_stream = 0
    priority = 0

    def __init__(self, device=None, priority=0, **_kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or CpuEvent()
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class CpuEvent:
    """Stands in for torch.cuda.Event; elapsed_time uses the host clock."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **_kwargs):
        self._time = None

    def record(self, stream=None):
        self._time = time.perf_counter()

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end: "CpuEvent") -> float:
        if self._time is None or end._time is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end._time - self._time) * 1000.0


_DEFAULT_STREAM = CpuStream()


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _device_properties(device=None):
    return types.SimpleNamespace(
        name="cpu",
        total_memory=_host_memory_bytes(),
        major=0,
        minor=0,
        multi_processor_count=os.cpu_count() or 1,
        is_integrated=False,
        is_multi_gpu_board=False,
        gcnArchName="",  # empty, as on NVIDIA devices (torch's compile cache reads it)
        warp_size=1,
        L2_cache_size=0,
        uuid="cpu",
    )


def _noop(*_args, **_kwargs):
    return None


def _zero(*_args, **_kwargs):
    return 0


def _get_rng_state(device="cuda"):
    return torch.get_rng_state()


def _set_rng_state(new_state, device="cuda"):
    torch.set_rng_state(new_state)


def _manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


def _megatron_get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
    if graph_safe:
        raise RuntimeError("CUDA-graph-safe RNG state is not available on the CPU backend")
    return torch.get_rng_state()


def _megatron_set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    if graph_safe:
        raise RuntimeError("CUDA-graph-safe RNG state is not available on the CPU backend")
    torch.set_rng_state(new_state)


def _names_nccl(backend) -> bool:
    return backend is not None and "nccl" in str(backend).lower()


def _to_gloo(backend):
    return "gloo" if _names_nccl(backend) else backend


def _default_group_is_gloo() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "gloo"


def _move_split_sizes_to_host(tensor, as_numpy=False, record_stream=False):
    """megatron's maybe_move_tensor_to_cpu converts only CUDA tensors; host tensors must honour as_numpy too."""
    if torch.is_tensor(tensor):
        if tensor.device.type != "cpu":
            tensor = tensor.to(CPU, non_blocking=True)
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


CPU_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def _skip_cuda_kernel_build(args=None):
    return None


def _allow_no_cuda(wrapped, instance, args, kwargs):
    kwargs["allow_no_cuda"] = True
    return wrapped(*args, **kwargs)


@contextlib.contextmanager
def _null_context(*_args, **_kwargs):
    yield


class _CpuStreamContext(contextlib.nullcontext):
    def __init__(self, stream=None):
        super().__init__(stream)


# What the CPU backend hands out for side streams and events (see DeviceBackend.stream_module).
CPU_STREAMS = types.SimpleNamespace(Stream=CpuStream, Event=CpuEvent, stream=_CpuStreamContext,
                                    current_stream=lambda device=None: _DEFAULT_STREAM)


def _distinct(obj, target: str):
    """A separate function object per target: torch._dynamo keys its rules by object identity."""
    if isinstance(obj, types.FunctionType):
        fn = types.FunctionType(obj.__code__, obj.__globals__, target.rsplit(".", 1)[-1], obj.__defaults__,
                                obj.__closure__)
        fn.__kwdefaults__ = obj.__kwdefaults__
        fn.__qualname__ = f"cpu_backend.{target}"
        return fn
    return obj


def _torch_cuda_patches() -> PatchSet:
    ps = PatchSet(
        "device:cpu", needed_on=CPU_ONLY,
        changes="the torch.cuda calls megatron makes (current device, RNG state, streams, events, synchronize, memory "
                "statistics, device properties, nvtx) get CPU equivalents; torch.cuda.is_available() stays False",
        unpatched="without a GPU, megatron's torch.cuda calls raise ('Torch not compiled with CUDA enabled' or "
                  "'Found no NVIDIA driver')")
    torch_versions = Contract(versions=">=2.4", package="torch")
    replacements = {
        "torch.cuda.current_device": _zero,
        "torch.cuda.set_device": _noop,
        "torch.cuda.device_count": lambda: 1,
        "torch.cuda.synchronize": _noop,
        "torch.cuda.empty_cache": _noop,
        "torch.cuda.get_rng_state": _get_rng_state,
        "torch.cuda.set_rng_state": _set_rng_state,
        "torch.cuda.random.get_rng_state": _get_rng_state,
        "torch.cuda.random.set_rng_state": _set_rng_state,
        "torch.cuda.manual_seed": _manual_seed,
        "torch.cuda.manual_seed_all": _manual_seed,
        "torch.cuda.default_generators": (torch.default_generator,),
        "torch.cuda.Stream": CpuStream,
        "torch.cuda.ExternalStream": CpuStream,
        "torch.cuda.Event": CpuEvent,
        "torch.cuda.current_stream": lambda device=None: _DEFAULT_STREAM,
        "torch.cuda.default_stream": lambda device=None: _DEFAULT_STREAM,
        "torch.cuda.set_stream": _noop,
        "torch.cuda.stream": _CpuStreamContext,
        "torch.cuda.device": _null_context,
        "torch.cuda.memory_allocated": _zero,
        "torch.cuda.max_memory_allocated": _zero,
        "torch.cuda.memory_reserved": _zero,
        "torch.cuda.max_memory_reserved": _zero,
        "torch.cuda.reset_peak_memory_stats": _noop,
        "torch.cuda.reset_max_memory_allocated": _noop,
        "torch.cuda.memory_stats": lambda device=None: {},
        "torch.cuda.get_device_properties": _device_properties,
        "torch.cuda.get_device_name": lambda device=None: "cpu",
        "torch.cuda.get_device_capability": lambda device=None: (0, 0),
        "torch.cuda.nvtx.range_push": _noop,
        "torch.cuda.nvtx.range_pop": _noop,
        "torch.cuda.nvtx.mark": _noop,
        "torch.cuda.nvtx.range": _null_context,
    }
    for target, new in replacements.items():
        ps.replace(target, _distinct(new, target), contract=torch_versions)
    return ps


def _megatron_core_patches() -> PatchSet:
    ps = PatchSet(
        "device:cpu:megatron-core", needed_on=CPU_ONLY,
        changes="megatron's CUDA RNG-state helpers use the CPU generator (what dropout draws from here); MoE's "
                "split sizes, already host tensors, honour maybe_move_tensor_to_cpu's as_numpy",
        unpatched="the RNG tracker's CUDA state calls fail without a GPU; megatron ignores as_numpy for host "
                  "tensors, so the MoE all-to-all dispatcher gets tensors where it expects numpy split sizes")
    # MoE's all-to-all split sizes are host tensors here; megatron converts them to numpy only from CUDA.
    ps.replace("megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu", _move_split_sizes_to_host,
               contract=Contract(versions=SUPPORTED_MEGATRON_CORE))
    ps.replace(
        "megatron.core.tensor_parallel.random._get_cuda_rng_state",
        _megatron_get_cuda_rng_state,
        contract=Contract(versions=SUPPORTED_MEGATRON_CORE),
    )
    ps.replace(
        "megatron.core.tensor_parallel.random._set_cuda_rng_state",
        _megatron_set_cuda_rng_state,
        contract=Contract(versions=SUPPORTED_MEGATRON_CORE),
    )
    return ps


class CpuBackend(DeviceBackend):
    name = "cpu"
    dist_backend = "gloo"

    def __init__(self) -> None:
        super().__init__()
        self._mode: CudaToCpuMode | None = None
        self._saved_env: dict[str, str | None] = {}

    pins_host_memory = False  # the "host" copy is another CPU buffer: nothing to pin

    def torch_device(self) -> torch.device:
        return CPU

    def stream_module(self):
        return CPU_STREAMS

    def device_patch_sets(self):
        return [_torch_cuda_patches(), self._process_group_patches(), _megatron_core_patches()]

    def _process_group_patches(self) -> PatchSet:
        ps = PatchSet(
            "device:cpu:process-groups", needed_on=CPU_ONLY,
            changes="NCCL process groups become gloo when the CPU was chosen on purpose (MM_ADAPTOR_DEVICE=cpu, "
                    "devices.install('cpu')) or the default group is gloo; chosen only because no accelerator was "
                    "found, an NCCL default group is refused with one line saying how to choose the CPU",
            unpatched="NCCL cannot start without a GPU")
        torch_versions = Contract(versions=">=2.4", package="torch")
        ps.wrap("torch.distributed.distributed_c10d.init_process_group", self._init_process_group_on_gloo,
                contract=torch_versions)
        ps.wrap("torch.distributed.distributed_c10d.new_group", self._new_group_on_gloo, contract=torch_versions)
        return ps

    def check_distributed_backend(self, requested, *, asked_by: str, how_to_choose_cpu: str) -> None:
        if not self.chosen_automatically or not _names_nccl(requested):
            return
        raise NoAcceleratorError(
            f"{asked_by} asks for NVIDIA GPUs, but torch sees no CUDA device, so the CPU backend was chosen only "
            f"because no accelerator was found; to train on the CPU on purpose, {how_to_choose_cpu} or set "
            "MM_ADAPTOR_DEVICE=cpu (otherwise check the GPU driver, e.g. with nvidia-smi)")

    def _init_process_group_on_gloo(self, wrapped, instance, args, kwargs):
        if args:
            kwargs["backend"], args = args[0], args[1:]
        requested = kwargs.get("backend")
        self.check_distributed_backend(requested, how_to_choose_cpu="use backend='gloo'",
                                       asked_by=f"torch.distributed.init_process_group(backend={requested!r})")
        kwargs["backend"] = _to_gloo(requested) or "gloo"
        kwargs.pop("device_id", None)
        return wrapped(*args, **kwargs)

    def _new_group_on_gloo(self, wrapped, instance, args, kwargs):
        requested = args[2] if len(args) >= 3 else kwargs.get("backend")
        if _names_nccl(requested) and not _default_group_is_gloo():
            self.check_distributed_backend(requested, asked_by=f"torch.distributed.new_group(backend={requested!r})",
                                           how_to_choose_cpu="use backend='gloo'")
        if len(args) >= 3:
            args = list(args)
            args[2] = _to_gloo(args[2])
            if len(args) >= 4:
                args[3] = None
        if "backend" in kwargs:
            kwargs["backend"] = _to_gloo(kwargs["backend"])
        if kwargs.get("pg_options") is not None and (kwargs.get("backend") in (None, "gloo")):
            kwargs["pg_options"] = None
        return wrapped(*args, **kwargs)

    def training_patch_sets(self):
        ps = PatchSet(
            "device:cpu:megatron-training", needed_on=CPU_ONLY,
            changes="Megatron-LM's 'Megatron requires CUDA' check is lifted and its legacy fused CUDA kernel build "
                    "skipped",
            unpatched="initialize_megatron asserts 'Megatron requires CUDA.'")
        contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
        ps.wrap("megatron.training.initialize.initialize_megatron", _allow_no_cuda, contract=contract)
        # Megatron-LM's legacy fused CUDA kernels (built with nvcc at start-up) cannot run on the CPU.
        ps.replace("megatron.legacy.fused_kernels.load", _skip_cuda_kernel_build, contract=contract)
        return [ps]

    def _activate(self) -> None:
        # Megatron-LM asserts this CUDA scheduling setting for TP; it has no meaning on the CPU.
        self._saved_env = {k: os.environ.get(k) for k in CPU_ENV}
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
        self._mode = CudaToCpuMode()
        self._mode.__enter__()

    def _deactivate(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

