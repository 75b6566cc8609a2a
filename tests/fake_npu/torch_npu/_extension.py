"""Builds (once per torch version, cached by torch's extension builder) and loads the FAKE npu device library."""

from __future__ import annotations

import os
import re

import torch

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "fake_npu.cpp")


def name() -> str:
    return "fake_npu_torch_" + re.sub(r"[^0-9A-Za-z]", "_", torch.__version__)


def load() -> None:
    from torch.utils import cpp_extension

    cpp_extension.load(name(), [SOURCE], is_python_module=False, extra_cflags=["-O1"], verbose=False)
