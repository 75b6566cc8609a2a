"""`torch.npu` of the FAKE npu device (tests only): devices, streams, events, memory counters and RNG state.

Work is synchronous, except non-blocking copies issued on a side stream, which wait for that stream's
synchronisation (see Stream). Random ops on `npu` tensors draw
from `default_generators` (one host generator per fake device), not from torch's CPU generator.
"""

from __future__ import annotations

import contextlib
import threading
import time
import types
import weakref

import torch

FAKE = True


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return _INITIALIZED[0]


def init() -> None:
    _lazy_init()


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return torch._C._get_privateuse1_backend_name() == "npu" and _count()


def _count() -> int:
    import os

    from torch_npu import DEVICES_ENV

    return int(os.environ.get(DEVICES_ENV, "1"))


def current_device() -> int:
    return torch.ops.fake_npu.current_device()


def _index(device) -> int:
    if device is None:
        return current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        return current_device() if device.index is None else device.index
    return int(device)


def set_device(device) -> None:
    torch.ops.fake_npu.set_device(_index(device))


@contextlib.contextmanager
def device(index):
    previous = current_device()
    set_device(index)
    try:
        yield
    finally:
        set_device(previous)


def empty_cache() -> None:
    pass


class Stream(torch.Stream):
    """A stream of the fake device. Work runs as it is issued, except a non-blocking copy issued while a stream
    other than the default one is current: that copy is queued here and its destination holds NaN (or -1) until
    the queue runs, when the stream is synchronised or waited on (wait_stream, an event recorded on it). A wait
    the code forgets then shows as a wrong value, as it can on the device."""

    def __new__(cls, device=None, priority=0, **_kwargs):
        return super().__new__(cls, device=torch.device("npu", _index(device)), priority=priority)

    def __init__(self, device=None, priority=0, **_kwargs):
        self.npu_stream = 0
        self._queued: list = []

    def _defer(self, work) -> None:
        DEFERRED["copies"] += 1
        self._queued.append(work)
        _WITH_QUEUED.add(self)

    def _run_queued(self) -> None:
        queued = getattr(self, "_queued", [])
        while queued:
            queued.pop(0)()

    def wait_stream(self, stream):
        stream._run_queued()

    def wait_event(self, event):
        event.wait(self)

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self):
        self._run_queued()

    def query(self):
        return not getattr(self, "_queued", [])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Event:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **_kwargs):
        self._time, self._stream = None, None

    def record(self, stream=None):
        self._time, self._stream = time.perf_counter(), stream or current_stream()

    def wait(self, stream=None):
        if self._stream is not None:
            self._stream._run_queued()

    synchronize = wait

    def query(self):
        return self._stream is None or self._stream.query()

    def elapsed_time(self, end) -> float:
        return (end._time - self._time) * 1000.0


DEFERRED = {"copies": 0}  # how many copies a side stream queued (tests assert the model ran)
_WITH_QUEUED: weakref.WeakSet = weakref.WeakSet()
_DEFAULT_STREAMS: dict[int, Stream] = {}
_CURRENT = threading.local()


def default_stream(device=None) -> Stream:
    index = _index(device)
    return _DEFAULT_STREAMS.setdefault(index, Stream(index))


def current_stream(device=None) -> Stream:
    chosen = getattr(_CURRENT, "stream", None)
    return chosen if chosen is not None else default_stream(device)


def set_stream(stream) -> None:
    _CURRENT.stream = stream


@contextlib.contextmanager
def stream(chosen):
    previous = getattr(_CURRENT, "stream", None)
    _CURRENT.stream = chosen
    try:
        yield chosen
    finally:
        _CURRENT.stream = previous


def synchronize(device=None) -> None:
    for queued in list(_WITH_QUEUED):
        queued._run_queued()


_copy = torch.Tensor.copy_


def _poison(tensor) -> None:
    with torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            _copy(tensor, torch.full(tensor.shape, float("nan"), dtype=tensor.dtype))
        elif tensor.dtype != torch.bool:
            _copy(tensor, torch.full(tensor.shape, -1, dtype=tensor.dtype))


def _copy_on_current_stream(self, src, non_blocking=False):
    side = getattr(_CURRENT, "stream", None)
    involves_npu = self.device.type == "npu" or (isinstance(src, torch.Tensor) and src.device.type == "npu")
    if not non_blocking or side is None or side is default_stream(side.device_index) or not involves_npu:
        return _copy(self, src, non_blocking)
    _poison(self)
    side._defer(lambda: _copy(self, src))
    return self


torch.Tensor.copy_ = _copy_on_current_stream


def memory_allocated(device=None) -> int:
    return torch.ops.fake_npu.memory_allocated()


def max_memory_allocated(device=None) -> int:
    return torch.ops.fake_npu.max_memory_allocated()


memory_reserved = memory_allocated
max_memory_reserved = max_memory_allocated


def reset_peak_memory_stats(device=None) -> None:
    torch.ops.fake_npu.reset_peak_memory_stats()


reset_max_memory_allocated = reset_peak_memory_stats


def memory_stats(device=None) -> dict:
    return {"allocated_bytes.all.current": memory_allocated(), "allocated_bytes.all.peak": max_memory_allocated(),
            "num_alloc_retries": 0}


def get_device_properties(device=None):
    """As torch_npu before 7.2.0: no major/minor (torch_npu's properties are not a CUDA compute capability)."""
    return types.SimpleNamespace(name="FAKE npu (host memory)", total_memory=64 << 30, multi_processor_count=1,
                                 is_integrated=False)


def get_device_name(device=None) -> str:
    return "FAKE npu (host memory)"


def get_device_capability(device=None):
    """None, as torch_npu answers."""
    return None


# RNG: one host generator per fake device, made at lazy initialisation as torch_npu makes them: until then
# default_generators is an empty tuple, afterwards a new tuple bound to this module's attribute.
default_generators: tuple = ()
_INITIALIZED = [False]
_QUEUED: list = []


def _lazy_init() -> None:
    global default_generators
    if _INITIALIZED[0]:
        return
    generators = tuple(torch.Generator() for _ in range(max(_count(), 1)))
    for generator in generators:
        generator.manual_seed(67280421310721)
    default_generators = generators
    _INITIALIZED[0] = True
    while _QUEUED:
        _QUEUED.pop(0)()


def _generator(device=None) -> torch.Generator:
    _lazy_init()
    return default_generators[_index(device)]


def get_rng_state(device="npu") -> torch.Tensor:
    return _generator(device).get_state()


def set_rng_state(new_state, device="npu") -> None:
    _generator(device).set_state(new_state.cpu() if new_state.device.type != "cpu" else new_state)


def get_rng_state_all():
    _lazy_init()
    return [g.get_state() for g in default_generators]


def set_rng_state_all(states) -> None:
    _lazy_init()
    for g, s in zip(default_generators, states):
        g.set_state(s)


def manual_seed(seed) -> None:
    _generator(None).manual_seed(int(seed))


def manual_seed_all(seed) -> None:
    _lazy_init()
    for g in default_generators:
        g.manual_seed(int(seed))


def seed() -> None:
    _generator(None).seed()


def initial_seed() -> int:
    return _generator(None).initial_seed()


def _lazy_call(callable, **_kwargs):
    """Runs at once when initialised, else at lazy initialisation, as torch_npu's."""
    if _INITIALIZED[0]:
        callable()
    else:
        _QUEUED.append(callable)
