"""Markers for tests of code that exists only in some megatron-core releases of the supported range."""

import importlib.metadata

import pytest
from packaging.version import Version

INSTALLED = Version(importlib.metadata.version("megatron-core"))

requires_grouped_mlp = pytest.mark.skipif(
    INSTALLED >= Version("0.17"),
    reason="megatron-core 0.17 removed GroupedMLP (the 0.16.1 leg runs this; tests/latest covers 0.17+'s path)")
