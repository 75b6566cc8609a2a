"""Native ops: PyTorch custom operators in the `mm_adaptor` namespace, dispatched by the tensor's device.

Each op has a native CPU kernel (C++), a CUDA kernel (.cu), an NPU implementation (torch_npu), a fake
implementation, an autograd formula and a plain-PyTorch reference (`mm_adaptor.ops.reference`). Kernels are
built just in time on first use (or ahead of time with `mm-adaptor build-ops`); where no build is possible
the reference runs, with one warning.
"""

from __future__ import annotations

import torch

from mm_adaptor.ops import library
from mm_adaptor.ops.attention import flash_attention
from mm_adaptor.ops.library import ensure, op

__all__ = ["rms_norm", "swiglu", "rotary_pos_emb", "matmul_add_fp32", "grouped_matmul", "flash_attention",
           "status", "build"]

OP_NAMES = ("rms_norm", "swiglu", "rotary_pos_emb", "matmul_add_fp32", "grouped_matmul", "flash_attention")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, fp32 accumulation."""
    ensure(x.device.type)
    return op("rms_norm_fwd")(x, weight, float(eps))[0]


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's convention: a, b = x.chunk(2, -1); silu(a) * b. Backward recomputes silu from x."""
    ensure(x.device.type)
    return op("swiglu_fwd")(x)


def rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Megatron's apply_rotary_pos_emb for [s, b, h, d]: rotates the first freqs.shape[-1] channels."""
    ensure(t.device.type)
    return op("rotary_pos_emb_fwd")(t, freqs, bool(interleaved))


def matmul_add_fp32(main_grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    """main_grad (fp32) += grad_output^T @ input, without fp32 copies of the inputs."""
    ensure(main_grad.device.type)
    op("matmul_add_fp32")(main_grad, grad_output, input)


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Expert GEMMs over token-sorted rows: y[rows of e] = x[rows of e] @ weights[e]."""
    ensure(x.device.type)
    if not torch.is_tensor(tokens_per_expert):
        tokens_per_expert = torch.tensor(list(tokens_per_expert), dtype=torch.long)
    return op("grouped_matmul_fwd")(x, weights, tokens_per_expert.to("cpu", torch.long))


def build(device: str = "cpu", verbose: bool = True):
    from mm_adaptor.ops import builder

    return builder.build(device, verbose=verbose)


def status() -> dict:
    """What `mm-adaptor report` shows: per device, whether native kernels are loaded, cached, or unavailable."""
    import torch

    from mm_adaptor.ops import builder

    loaded = library.status()
    devices = {}
    for device in ("cpu", "cuda", "npu"):
        if device in loaded:
            devices[device] = ("native" if loaded[device]["native"] else "reference fallback") + \
                f": {loaded[device]['why']}"
            continue
        if device == "npu":
            devices[device] = "torch_npu fused kernels when torch_npu is installed (not verified on NPU hardware)"
            continue
        if device == "cuda" and not torch.cuda.is_available():
            devices[device] = "no CUDA device here: CUDA kernels not built (their sources are compile-checked with nvcc)"
            continue
        try:
            cached = builder.cached_library(device)
            devices[device] = (f"native, built and cached ({cached})" if cached else
                               "native, not built yet: builds on first use or with `mm-adaptor build-ops`")
        except builder.BuildUnavailable as exc:
            devices[device] = f"reference fallback: {exc}"
    note = ("flash_attention runs PyTorch's fused SDPA kernels (flash / memory-efficient) on every device, and a "
            "blockwise fp32 kernel in PyTorch ops for attention dropout on the CPU; the other ops have their own "
            "kernels")
    return {"devices": devices, "ops": OP_NAMES, "note": note, "cache": str(builder.cache_root())}
