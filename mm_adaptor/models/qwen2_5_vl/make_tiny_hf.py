"""`python -m mm_adaptor.models.qwen2_5_vl.make_tiny_hf OUT [--seed N]`: mm_adaptor.models.make_tiny_hf for
Qwen2.5-VL (kept for scripts that name it)."""

from __future__ import annotations

import sys

from mm_adaptor.models import make_tiny_hf as _maker


def make_tiny_hf(out: str, seed: int = 0):
    return _maker.make_tiny_hf(out, "qwen2_5_vl", seed)


if __name__ == "__main__":
    raise SystemExit(_maker.main([*sys.argv[1:], "--model", "qwen2_5_vl"]))
