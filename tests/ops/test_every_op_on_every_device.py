"""Every `mm_adaptor::` operator has a kernel for the CPU and the CUDA dispatch keys once its device's kernels are
loaded (native where the library builds, else the references), so no op can be missing on one device again."""

import importlib
import re
import shutil
from pathlib import Path

import pytest
import warm_python

import mm_adaptor.ops

OPS_DIR = Path(mm_adaptor.ops.__file__).parent

_CHECK = """
import warnings
import torch
from mm_adaptor.ops import library

warnings.simplefilter("ignore")  # without a GPU the CUDA references register with a warning
states = {device: library.ensure(device) for device in library.DISPATCH_KEYS}
missing = [f"{name} on {key}" for name in library.SPECS for key in library.DISPATCH_KEYS.values()
           if not torch._C._dispatch_has_kernel_for_dispatch_key(f"mm_adaptor::{name}", key)]
print("native:", {device: state["native"] for device, state in states.items()})
print("missing:", ", ".join(missing) or "none")
"""


def test_every_op_has_a_kernel_for_every_device_key():
    # a process of its own: registering the CUDA references must not leak into other tests
    done = warm_python.run(["-c", _CHECK], timeout=600)
    assert done.returncode == 0, done.stderr
    assert "missing: none" in done.stdout, done.stdout


def registrations(text: str, key: str) -> list[str]:
    """The ops a source registers for `key` (or for the library's own key, in device-generic code)."""
    names = []
    for block in re.findall(r"TORCH_LIBRARY_IMPL\(mm_adaptor, (\w+), m\) \{(.*?)\n\}", text, re.S):
        if block[0] in (key, "MM_ADAPTOR_DISPATCH_KEY"):
            names += re.findall(r'm\.impl\("(\w+)"', block[1])
    return names


def registered_natively(device: str) -> list[str]:
    """The ops `device`'s native library registers, from its sources; an op twice if two sources register it."""
    from mm_adaptor.ops import builder

    key = builder.DISPATCH_KEYS[device]
    return sorted(name for source in builder.sources(device) for name in registrations(source.read_text(), key))


def declared_native(device: str) -> list[str]:
    from mm_adaptor.ops import library

    return sorted(name for name, spec in library.SPECS.items() if device in spec.native)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_native_library_registers_every_op_for_its_device(device):
    """Checked on the sources, so the CUDA library is covered on a machine that cannot build it."""
    from mm_adaptor.ops import builder

    assert declared_native(device)
    assert registered_natively(device) == declared_native(device)
    assert f"-DMM_ADAPTOR_DISPATCH_KEY={builder.DISPATCH_KEYS[device]}" in builder.cxx_flags(device)


def test_the_source_check_sees_a_missing_op(monkeypatch, tmp_path):
    from mm_adaptor.ops import builder

    shutil.copytree(builder.CSRC, tmp_path / "csrc")
    monkeypatch.setattr(builder, "CSRC", tmp_path / "csrc")
    source = tmp_path / "csrc" / "cpu" / "swiglu.cpp"
    source.write_text(source.read_text().replace('m.impl("swiglu_bwd", &swiglu_bwd);', ""))
    assert "swiglu_bwd" not in registered_natively("cpu")
    assert "swiglu_bwd" in declared_native("cpu")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_source_named_after_an_op_module_holds_that_ops_kernels(device):
    """csrc/<device>/rms_norm.cpp (or .cu) registers what ops/rms_norm.py declares native, and nothing else."""
    from mm_adaptor.ops import builder

    key = builder.DISPATCH_KEYS[device]
    checked = 0
    for source in builder.sources(device):
        if not (OPS_DIR / f"{source.stem}.py").exists():
            continue
        module = importlib.import_module(f"mm_adaptor.ops.{source.stem}")
        expected = sorted(spec.name for spec in module.SPECS if device in spec.native)
        assert sorted(registrations(source.read_text(), key)) == expected, source
        checked += 1
    assert checked, f"no {device} source is named after an op module"
