"""Every `mm_adaptor::` operator has a kernel for the CPU and the CUDA dispatch keys once its device's kernels are
loaded (native where the library builds, else the references), so no op can be missing on one device again."""

import re
import subprocess
import sys

import pytest

_CHECK = """
import warnings
import torch
from mm_adaptor.ops import library

warnings.simplefilter("ignore")  # without a GPU the CUDA references register with a warning
states = {device: library.ensure(device) for device in library.DISPATCH_KEYS}
missing = [f"{name} on {key}" for name in library.SCHEMAS for key in library.DISPATCH_KEYS.values()
           if not torch._C._dispatch_has_kernel_for_dispatch_key(f"mm_adaptor::{name}", key)]
print("native:", {device: state["native"] for device, state in states.items()})
print("missing:", ", ".join(missing) or "none")
"""


def test_every_op_has_a_kernel_for_every_device_key():
    # a fresh process: registering the CUDA references must not leak into other tests
    done = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "missing: none" in done.stdout, done.stdout


def _registered_natively(device: str) -> set[str]:
    """The ops each source of `device`'s native library registers for that library's dispatch key."""
    from mm_adaptor.ops import builder

    key = builder.DISPATCH_KEYS[device]
    names = set()
    for source in builder.sources(device):
        for block in re.findall(r"TORCH_LIBRARY_IMPL\(mm_adaptor, (\w+), m\) \{(.*?)\n\}", source.read_text(), re.S):
            if block[0] in (key, "MM_ADAPTOR_DISPATCH_KEY"):
                names.update(re.findall(r'm\.impl\("(\w+)"', block[1]))
    return names


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_native_library_registers_every_op_for_its_device(device):
    """Checked on the sources, so the CUDA library is covered on a machine that cannot build it."""
    from mm_adaptor.ops import builder, library

    assert _registered_natively(device) == set(library.SCHEMAS)
    assert f"-DMM_ADAPTOR_DISPATCH_KEY={builder.DISPATCH_KEYS[device]}" in builder.cxx_flags(device)
