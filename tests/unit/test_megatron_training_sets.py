"""The CPU and NPU backends' Megatron-LM training sets skip `megatron.legacy.fused_kernels.load` only where that
module exists: core_v0.16 builds the legacy kernels at start-up, 0.17+ removed megatron.legacy (a target that does
not exist would refuse the whole set, and with it pretrain_gpt.py, on 0.19)."""

import importlib.machinery
import sys
import types

import pytest

from mm_adaptor.devices.cpu import CpuBackend
from mm_adaptor.devices.npu import NpuBackend

LOAD = "megatron.legacy.fused_kernels.load"
INITIALIZE = "megatron.training.initialize.initialize_megatron"


def legacy_absent(monkeypatch):
    """As on megatron-core 0.19: no megatron.legacy package."""
    monkeypatch.delitem(sys.modules, "megatron.legacy.fused_kernels", raising=False)
    monkeypatch.setitem(sys.modules, "megatron.legacy", None)


def legacy_present(monkeypatch):
    """As on megatron-core 0.16: megatron.legacy.fused_kernels importable."""
    module = types.ModuleType("megatron.legacy.fused_kernels")
    module.__spec__ = importlib.machinery.ModuleSpec("megatron.legacy.fused_kernels", None)
    monkeypatch.setitem(sys.modules, "megatron.legacy.fused_kernels", module)


@pytest.mark.parametrize("backend", [CpuBackend, NpuBackend], ids=["cpu", "npu"])
def test_legacy_fused_kernels_are_skipped_only_where_they_exist(monkeypatch, backend):
    with monkeypatch.context() as m:
        legacy_absent(m)
        (absent,) = backend().training_patch_sets()
    assert LOAD not in absent.targets()
    assert INITIALIZE in absent.targets()  # the CUDA check is still lifted
    with monkeypatch.context() as m:
        legacy_present(m)
        (present,) = backend().training_patch_sets()
    assert LOAD in present.targets() and INITIALIZE in present.targets()
