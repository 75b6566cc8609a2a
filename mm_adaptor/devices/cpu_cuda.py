"""torch.cuda on the CPU: the stand-ins the CPU backend installs for the torch.cuda calls megatron makes (current
device, RNG state, streams, events, synchronize, memory statistics, device properties, nvtx), as one patch set.
torch.cuda.is_available() stays False, so torch's own internals keep their CPU paths."""

from __future__ import annotations

import contextlib
import os
import time
import types

import torch

from mm_adaptor.devices.redirect import distinct
from mm_adaptor.core.patching import Contract, PatchSet

CPU = torch.device("cpu")
CPU_ONLY = "the CPU backend only"


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


@contextlib.contextmanager
def _null_context(*_args, **_kwargs):
    yield


class _CpuStreamContext(contextlib.nullcontext):
    def __init__(self, stream=None):
        super().__init__(stream)


# What the CPU backend hands out for side streams and events (see DeviceBackend.stream_module).
CPU_STREAMS = types.SimpleNamespace(Stream=CpuStream, Event=CpuEvent, stream=_CpuStreamContext,
                                    current_stream=lambda device=None: _DEFAULT_STREAM)


def torch_cuda_patches() -> PatchSet:
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
