"""Ascend NPU backend through torch_npu: torch.cuda calls redirected to torch.npu, NCCL to HCCL.

A code path only: it has not been run on NPU hardware (`mm-adaptor report` says so).
"""

from __future__ import annotations

import torch

from mm_adaptor.devices.base import DeviceBackend
from mm_adaptor.patching import Contract, PatchSet

REDIRECTED = (
    "current_device", "set_device", "device_count", "synchronize", "empty_cache", "get_rng_state",
    "set_rng_state", "manual_seed", "manual_seed_all", "Stream", "Event", "current_stream", "default_stream",
    "set_stream", "stream", "device", "memory_allocated", "max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "reset_peak_memory_stats", "memory_stats", "get_device_properties",
    "get_device_name", "is_available",
)


def _to_hccl(wrapped, instance, args, kwargs):
    if args:
        kwargs["backend"], args = args[0], args[1:]
    backend = kwargs.get("backend")
    if backend is None or "nccl" in str(backend).lower():
        kwargs["backend"] = "hccl"
    return wrapped(*args, **kwargs)


class NpuBackend(DeviceBackend):
    name = "npu"
    dist_backend = "hccl"

    def torch_device(self) -> torch.device:
        return torch.device("npu", torch.npu.current_device())

    def set_local_device(self, local_rank: int) -> None:
        torch.npu.set_device(local_rank % torch.npu.device_count())

    def devices_per_node(self) -> int:
        return torch.npu.device_count()

    def stream_module(self):
        return torch.npu

    def device_patch_sets(self):
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("the npu backend needs torch_npu (pip install torch-npu matching your torch)") from exc
        contract = Contract(versions=">=2.1", package="torch")
        ps = PatchSet("device:npu")
        for name in REDIRECTED:
            if hasattr(torch.npu, name):
                ps.replace(f"torch.cuda.{name}", getattr(torch.npu, name), contract=contract)
        ps.wrap("torch.distributed.distributed_c10d.init_process_group", _to_hccl, contract=contract)
        return [ps]
