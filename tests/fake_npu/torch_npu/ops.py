"""FAKE torch_npu op counters (tests only). The npu_* ops themselves (npu_grouped_matmul, npu_rms_norm, npu_swiglu,
npu_rotary_mul, npu_fusion_attention and their backward ops) are `torch.ops.npu.*` operators with torch_npu's schemas
in fused_ops.py and fusion_attention.py; each call counts here under its name."""

from __future__ import annotations

__all__: list[str] = []
CALLS: dict[str, int] = {}
