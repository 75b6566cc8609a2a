"""--virtual-optimizer is refused on the NPU backend when options are validated (before any rank starts), not at the
first optimizer step: torch_npu's swapped memory cannot take the in-place element-wise Adam it runs."""

import argparse
import types

import pytest

from mm_adaptor import devices

from mm_adaptor.core import features
from mm_adaptor.feature_flags.virtual_optimizer import NPU_REFUSAL, VirtualOptimizer


def _options(**kwargs):
    return argparse.Namespace(virtual_optimizer=float("inf"), swap_optimizer=False, reuse_fp32_param=False,
                              use_distributed_optimizer=True, **kwargs)


def test_refused_on_the_npu_backend(monkeypatch):
    monkeypatch.setattr(devices, "current", lambda: types.SimpleNamespace(name="npu"))
    feature = VirtualOptimizer()
    assert feature.can_run_here() == (False, NPU_REFUSAL)
    with pytest.raises(features.FeatureConfigError, match="--virtual-optimizer: refused on the NPU backend"):
        feature.validate(_options())


def test_served_on_the_cpu_backend(monkeypatch):
    monkeypatch.setattr(devices, "current", lambda: types.SimpleNamespace(name="cpu"))
    feature = VirtualOptimizer()
    assert feature.can_run_here() == (True, "yes")
    feature.validate(_options())
