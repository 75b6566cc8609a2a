"""FAKE torch_npu for tests: PyTorch's PrivateUse1 device renamed `npu`, host memory behind it. NOT an Ascend NPU.

Put tests/fake_npu on sys.path (a fresh interpreter: importing this changes torch for the whole process) and
`import torch_npu`. Devices: MM_ADAPTOR_FAKE_NPU_DEVICES (default 1). What it provides and what it cannot show:
`report()`.
"""

from __future__ import annotations

import os

import torch

__version__ = "0.0.0+FAKE-npu-for-tests"
FAKE = True
DEVICES_ENV = "MM_ADAPTOR_FAKE_NPU_DEVICES"

from torch_npu import _extension  # noqa: E402

_extension.load()
torch.ops.fake_npu.set_device_count(int(os.environ.get(DEVICES_ENV, "1")))
torch.utils.rename_privateuse1_backend("npu")

from torch_npu import npu as _npu_module  # noqa: E402

torch._register_device_module("npu", _npu_module)
torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)

from torch_npu import _random, fused_ops, fusion_attention, hccl, ops  # noqa: E402,F401
from torch_npu.ops import *  # noqa: E402,F401,F403

# torch.ops.npu.* operators with torch_npu's schemas, exposed as torch_npu.<name> as torch_npu does
globals().update(fused_ops.register())
globals().update(fusion_attention.register(fused_ops.LIB, fused_ops.define))

_random.register()
hccl.register()
# After the fake's own kernels, which it leaves alone. MM_ADAPTOR_FAKE_NPU_BREAK=composite skips it (a test's
# broken variant: the decompositions then round differently from the CPU backend).
CPU_ROUTED_OPS = 0 if os.environ.get("MM_ADAPTOR_FAKE_NPU_BREAK") == "composite" else _extension.route_to_cpu_kernels()

from torch_npu import _probe  # noqa: E402

_probe.install()


def report() -> str:
    return ("FAKE torch_npu (tests only, not Ascend hardware): PrivateUse1 device 'npu' on host memory, "
            f"{torch.npu.device_count()} device(s); each op's CPU kernel through the CPU fallback; random ops from "
            "its own per-device generator; torch_npu's npu_* ops (grouped_matmul, rms_norm, swiglu, rotary_mul, "
            "fusion_attention and their backward ops) as reference math with torch_npu's schemas (op-plugin "
            "517f2e7d); 'hccl' is gloo with copies, refusing fp64. Cannot show: kernel numerics, HCCL timeouts, "
            "stream concurrency, swapped memory, speed.")
