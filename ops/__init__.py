"""Native ops: PyTorch custom operators in the `mm_adaptor` namespace, dispatched by the tensor's device.

Each op has one module (rms_norm.py, swiglu.py, rotary_pos_emb.py, matmul_add.py, grouped_matmul.py,
host_mapped.py, fp32_words.py, varlen_attention.py) holding
its schemas, fake implementations, autograd formula, plain-PyTorch reference and the kernel that serves each
device: native CPU (C++) and CUDA (.cu) kernels, torch_npu on the NPU; `library` registers them. Kernels are
built just in time on first use (or ahead of time with `mm-adaptor build-ops`); where no build is possible
the reference runs, with one warning.
"""

from __future__ import annotations

from mm_adaptor.ops import library
from mm_adaptor.ops.attention import flash_attention
from mm_adaptor.ops.fp32_words import join_fp32_words, split_fp32_words
from mm_adaptor.ops.grouped_matmul import grouped_matmul
from mm_adaptor.ops.host_mapped import host_mapped_copy
from mm_adaptor.ops.matmul_add import matmul_add_fp32
from mm_adaptor.ops.rms_norm import rms_norm
from mm_adaptor.ops.rotary_pos_emb import rotary_pos_emb
from mm_adaptor.ops.swiglu import swiglu
from mm_adaptor.ops.varlen_attention import varlen_attention, varlen_attention_with_lse

__all__ = ["rms_norm", "swiglu", "rotary_pos_emb", "matmul_add_fp32", "grouped_matmul", "flash_attention",
           "host_mapped_copy", "split_fp32_words", "join_fp32_words", "varlen_attention", "varlen_attention_with_lse",
           "status", "build"]

OP_NAMES = ("rms_norm", "swiglu", "rotary_pos_emb", "matmul_add_fp32", "grouped_matmul", "flash_attention",
            "host_mapped_copy", "split_fp32_words", "join_fp32_words", "round_split_fp32_words",
            "join_fp32_words_multi", "varlen_attention")


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
            devices[device] = ("no CUDA device here: CUDA kernels not built "
                               "(their sources are compile-checked with nvcc)")
            continue
        try:
            cached = builder.cached_library(device)
            devices[device] = (f"native, built and cached ({cached})" if cached else
                               "native, not built yet: builds on first use or with `mm-adaptor build-ops`")
        except builder.BuildUnavailable as exc:
            devices[device] = f"reference fallback: {exc}"
    note = ("flash_attention runs PyTorch's fused SDPA kernels (flash / memory-efficient) on CUDA and the CPU, "
            "torch_npu's npu_fusion_attention on an NPU, and a blockwise fp32 kernel in PyTorch ops where those "
            "cannot serve (attention dropout on the CPU); the other ops have their own kernels")
    builds = {}
    for device in ("cpu", "cuda"):
        try:
            info = builder.recorded_build(device)
        except builder.BuildUnavailable:
            continue
        builds[device] = "; ".join(f"{key} {value}" for key, value in info.items())
    return {"devices": devices, "ops": OP_NAMES, "note": note, "cache": str(builder.cache_root()), "builds": builds}
