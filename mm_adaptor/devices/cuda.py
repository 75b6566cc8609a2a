"""CUDA backend: megatron-core's native device; nothing to adapt beyond the no-TE compatibility fixes."""

from __future__ import annotations

import torch

from mm_adaptor.devices.base import DeviceBackend


class CudaBackend(DeviceBackend):
    name = "cuda"
    dist_backend = "nccl"

    def torch_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def set_local_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())

    def devices_per_node(self) -> int:
        return torch.cuda.device_count()

    def stream_module(self):
        return torch.cuda

    def device_patch_sets(self):
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda backend was requested but torch sees no CUDA device")
        return []
