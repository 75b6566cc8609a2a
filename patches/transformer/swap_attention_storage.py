"""Swap attention's storages (patches.transformer.swap_attention): the pooled host buffers, one saved storage's
way out to host memory and back, and the handle autograd keeps in place of a saved tensor."""

from __future__ import annotations

import collections
import weakref

import torch


class HostPool:
    """Host buffers by exact size, reused across steps. A buffer comes back with the event of the last copy that
    reads it; whoever takes it next makes its stream wait for that event before writing."""

    def __init__(self, backend):
        self.backend = backend
        self.free: dict[int, list] = collections.defaultdict(list)
        self.allocated_bytes = 0

    def take(self, nbytes: int):
        if self.free[nbytes]:
            return self.free[nbytes].pop()
        self.allocated_bytes += nbytes
        return self.backend.host_buffer(nbytes), None

    def give(self, buffer, last_reader_event) -> None:
        self.free[buffer.numel()].append((buffer, last_reader_event))


def _whole_storage(storage, device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class StoredStorage:
    """One device storage saved by the swapped modules of one layer pass: on the device, in host memory, kept
    (something else holds it), or restored."""

    def __init__(self, manager, storage, layer):  # swap_attention.SwapManager, LayerPass
        self.manager, self.layer = manager, layer
        self.nbytes = storage.nbytes()
        self.device = manager.device
        self.state = "device"
        self.keeper = _whole_storage(storage, self.device)
        self.host = self.offload_event = self.restored = self.prefetch_event = None
        self.waited = False

    # forward
    def offload(self) -> None:
        if self.keeper.untyped_storage().nbytes() != self.nbytes:  # released meanwhile by its owner (megatron's
            self.state = "kept"                                     # discard-output recompute): leave it to it
            return
        m = self.manager
        self.host, ready = m.pool.take(self.nbytes)
        m.offload_stream.wait_stream(m.backend.current_stream())
        if ready is not None:
            m.offload_stream.wait_event(ready)
        with m.backend.use_stream(m.offload_stream):
            self.host.copy_(self.keeper, non_blocking=True)
            self.offload_event = m.backend.new_event()
            self.offload_event.record(m.offload_stream)
        m.in_use_on(self.keeper, m.offload_stream)
        self.state = "copying"

    def release(self) -> None:
        """Let go of the device storage; keep it after all if anything else still holds it."""
        if self.state != "copying":
            return
        alive = weakref.ref(self.keeper.untyped_storage())
        self.keeper = None
        storage = alive()
        if storage is None:
            self.state = "host"
            self.manager.stats["offloaded_bytes"] += self.nbytes
            return
        self.keeper = _whole_storage(storage, self.device)
        self.manager.pool.give(self.host, self.offload_event)
        self.host = None
        self.state = "kept"
        self.manager.stats["kept_shared_bytes"] += self.nbytes

    # backward
    def prefetch(self, on_demand: bool = False) -> None:
        if self.state != "host":
            return
        m = self.manager
        source = m.host_source(self)
        self.restored = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        m.prefetch_stream.wait_stream(m.backend.current_stream())  # the allocation's earlier users are done
        m.prefetch_stream.wait_event(self.offload_event)
        with m.backend.use_stream(m.prefetch_stream):
            self.restored.copy_(source, non_blocking=True)
            self.prefetch_event = m.backend.new_event()
            self.prefetch_event.record(m.prefetch_stream)
        # allocated on the compute stream, written on the prefetch stream: if it is freed before unpack waits
        # (a graph dropped without backward), the allocator must not reuse it while the copy still writes
        m.in_use_on(self.restored, m.prefetch_stream)
        m.pool.give(self.host, self.prefetch_event)
        self.host = None
        self.state = "restored"
        m.stats["fetched_on_demand" if on_demand else "prefetched"] += 1

    def storage_for_unpack(self):
        if self.state == "host":
            self.prefetch(on_demand=True)
        if self.state == "restored":
            if not self.waited:
                self.manager.backend.current_stream().wait_event(self.prefetch_event)
                self.waited = True
            return self.restored.untyped_storage()
        return self.keeper.untyped_storage()

    def memory_residence(self) -> tuple[str, object, int]:
        """(residence, key that identifies the bytes, bytes) for the memory accountant."""
        if self.state in ("host", "copying"):
            return "host", ("swap", id(self)), self.nbytes
        held = self.restored if self.state == "restored" else self.keeper
        storage = held.untyped_storage()
        return "device", (storage.data_ptr(), storage.nbytes()), storage.nbytes()

    def __del__(self):
        try:
            if self.host is not None:  # never fetched back (forward without backward): the buffer goes home
                self.manager.pool.give(self.host, self.offload_event)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class SwappedTensor:
    """What autograd keeps in place of a saved tensor: its storage's record and how to view it again."""

    __slots__ = ("stored", "dtype", "offset", "size", "stride", "__weakref__")

    def __init__(self, stored: StoredStorage, t: torch.Tensor):
        self.stored, self.dtype = stored, t.dtype
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()

    def unpack(self) -> torch.Tensor:
        storage = self.stored.storage_for_unpack()
        return torch.empty(0, dtype=self.dtype, device=self.stored.device).set_(storage, self.offset, self.size,
                                                                                 self.stride)

    def memory_residence(self):
        return self.stored.memory_residence()
