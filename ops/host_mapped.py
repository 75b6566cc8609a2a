"""host_mapped_copy: a copy of a device tensor whose memory is host memory mapped into the device's address space,
so device kernels read and write it in place (no copy code). CUDA: csrc/cuda/host_mapped.cu (cudaHostAlloc with
cudaHostAllocMapped, wrapped as a CUDA tensor that frees it with cudaFreeHost); NPU: torch_npu's swapped-memory
allocation; CPU: the host is the device, an ordinary copy (the reference)."""

from __future__ import annotations

import torch

from mm_adaptor.ops.library import OpSpec, ensure, op, register


def reference(src):
    return src.clone()


def fake(src):
    return torch.empty_like(src)


def npu(src):
    import torch_npu

    allocate = getattr(torch_npu, "empty_with_swapped_memory", None)
    if allocate is None:
        raise RuntimeError("host_mapped_copy on NPU needs torch_npu.empty_with_swapped_memory, which arrived with "
                           "torch_npu 7.1.0")
    return allocate(src.shape, dtype=src.dtype, device=src.device).copy_(src)


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
