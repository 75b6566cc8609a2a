"""host_mapped_copy: a copy of a device tensor whose memory is host memory mapped into the device's address space,
so device kernels read and write it in place (no copy code). CUDA: csrc/cuda/host_mapped.cu (cudaHostAlloc with
cudaHostAllocMapped, wrapped as a CUDA tensor that frees it with cudaFreeHost); CPU: the host is the device, an
ordinary copy (the reference). NPU: refused. torch_npu's counterpart, empty_with_swapped_memory (torch_npu 7.1.0),
documents that its tensors take only fill_, zero_, npu_apply_adam_w and npu_hans_encode/decode, not the copy here nor
the element-wise Adam the virtual optimizer runs on them (docs/npu.md)."""

from __future__ import annotations

import torch

from mm_adaptor.ops.library import OpSpec, ensure, op, register


def reference(src):
    return src.clone()


def fake(src):
    return torch.empty_like(src)


SWAPPED_MEMORY_LIMITS = ("host_mapped_copy on NPU: torch_npu's swapped-memory tensors (empty_with_swapped_memory, "
                         "torch_npu 7.1.0) take only fill_, zero_, npu_apply_adam_w and npu_hans_encode/decode by "
                         "its documentation, not the copy and element-wise Adam the virtual optimizer needs; on an "
                         "NPU use --swap-optimizer to keep the optimizer state in host memory")


def npu(src):
    raise RuntimeError(SWAPPED_MEMORY_LIMITS)


SPECS = register(
    OpSpec("host_mapped_copy", "(Tensor src) -> Tensor", reference, fake, native=("cuda",), npu=npu),
)


def host_mapped_copy(src: torch.Tensor) -> torch.Tensor:
    """`src`'s values in host memory the device addresses directly (a tensor on src's device). On CUDA the
    reference would be an ordinary device copy, so there a missing native build is an error, not a fallback."""
    state = ensure(src.device.type)
    if src.device.type == "cuda" and not state["native"]:
        raise RuntimeError(f"host memory mapped into the GPU needs the native CUDA ops, which are unavailable here "
                           f"({state['why']}); build them with `mm-adaptor build-ops --device cuda`")
    return op("host_mapped_copy")(src)
