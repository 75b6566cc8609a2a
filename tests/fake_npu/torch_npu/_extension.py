"""Builds (once per torch version and source, cached by torch's extension builder) and loads the FAKE npu library."""

from __future__ import annotations

import hashlib
import os
import re

import torch

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "fake_npu.cpp")


def name() -> str:
    """Per torch version and per source: checkouts with other versions of the source (another worktree, an older
    commit) build their own library instead of rebuilding one that running processes are loading."""
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    return f"fake_npu_torch_{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}_{digest}"


def load() -> None:
    from torch.utils import cpp_extension

    cpp_extension.load(name(), [SOURCE], is_python_module=False, extra_cflags=["-O1"], verbose=False)


def composite_ops_with_cpu_kernels() -> list[str]:
    """aten ops with a CPU kernel that would otherwise run their CompositeExplicitAutograd decomposition on the fake
    device (e.g. native_layer_norm's math version, whose rounding differs from the CPU kernel's), leaving out those
    the fake implements itself."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    names = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::") or has(qualified, "PrivateUse1") or not has(qualified, "CPU"):
            continue
        if has(qualified, "CompositeExplicitAutograd") or has(qualified, "CompositeExplicitAutogradNonFunctional"):
            names.append(qualified[len("aten::"):])
    return sorted(names)


def route_to_cpu_kernels() -> int:
    """Every such op runs its CPU kernel through the fallback, as on the CPU backend (see fake_npu.cpp)."""
    return torch.ops.fake_npu.route_to_cpu_kernels(composite_ops_with_cpu_kernels())
