"""CPU backend: megatron-core's CUDA assumptions redirected to the CPU (devices/redirect.py), NCCL to gloo.

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

from mm_adaptor.devices.base import DeviceBackend, NoAcceleratorError
from mm_adaptor.devices.redirect import (Redirection, Target, distinct, names_nccl, new_group_request,
                                          process_group_request, rng_state_patches)
from mm_adaptor.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

CPU = torch.device("cpu")
CPU_ONLY = "the CPU backend only"


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


# gloo's gaps megatron runs into, handled before the shared redirection (CPU backend only).
GLOO_SPECIALS = {
    torch.distributed.isend: _isend_a_copy,
    torch.distributed.all_gather: _all_gather_uneven,
    torch.distributed.reduce_scatter: _reduce_scatter_list,
}


def cpu_target() -> Target:
    return Target("cpu", host_only=True, specials=GLOO_SPECIALS)


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
        ps.replace(target, distinct(new, target, "cpu_backend"), contract=torch_versions)
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
    rng_state_patches(ps, torch.get_rng_state, torch.set_rng_state, "the CPU backend")
    return ps


class CpuBackend(DeviceBackend):
    name = "cpu"
    dist_backend = "gloo"

    def __init__(self) -> None:
        super().__init__()
        self._redirection: Redirection | None = None

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
        if not self.chosen_automatically or not names_nccl(requested):
            return
        raise NoAcceleratorError(
            f"{asked_by} asks for NVIDIA GPUs, but torch sees no CUDA device, so the CPU backend was chosen only "
            f"because no accelerator was found; to train on the CPU on purpose, {how_to_choose_cpu} or set "
            "MM_ADAPTOR_DEVICE=cpu (otherwise check the GPU driver, e.g. with nvidia-smi)")

    def _init_process_group_on_gloo(self, wrapped, instance, args, kwargs):
        requested = (args[0] if args else kwargs.get("backend"))
        self.check_distributed_backend(requested, how_to_choose_cpu="use backend='gloo'",
                                       asked_by=f"torch.distributed.init_process_group(backend={requested!r})")
        _, args, kwargs = process_group_request(args, kwargs, "gloo")
        return wrapped(*args, **kwargs)

    def _new_group_on_gloo(self, wrapped, instance, args, kwargs):
        requested = args[2] if len(args) >= 3 else kwargs.get("backend")
        if names_nccl(requested) and not _default_group_is_gloo():
            self.check_distributed_backend(requested, asked_by=f"torch.distributed.new_group(backend={requested!r})",
                                           how_to_choose_cpu="use backend='gloo'")
        _, args, kwargs = new_group_request(args, kwargs, "gloo")
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
        self._redirection = Redirection(cpu_target(), CPU_ENV)
        self._redirection.enter()

    def _deactivate(self) -> None:
        if self._redirection is not None:
            self._redirection.exit()
            self._redirection = None

