"""FAKE torch_npu ops (tests only): the npu_* functions the project calls, with torch_npu's published signatures and
documented argument rules, computed by reference math. Not Ascend kernels: numerics here say nothing about them.

Source of the signatures and rules: torch_npu's API documentation for npu_grouped_matmul (PyTorch 2.1+ form:
`npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, ..., group_list=None, split_item=0,
group_type=None, group_list_type=0, act_type=0)`)."""

from __future__ import annotations

import torch

__all__ = ["npu_grouped_matmul"]
CALLS: dict[str, int] = {}


def _offsets(group_list, group_list_type, rows):
    if isinstance(group_list, torch.Tensor):
        values = [int(v) for v in group_list.cpu().tolist()]
    else:
        values = list(group_list)
        if len(values) == 1 or any(b <= a for a, b in zip(values, values[1:])):
            raise RuntimeError("npu_grouped_matmul (FAKE): a list group_list must be strictly increasing, length != 1")
    ends = values if group_list_type == 0 else [sum(values[:i + 1]) for i in range(len(values))]
    if ends and ends[-1] > rows:
        raise RuntimeError(f"npu_grouped_matmul (FAKE): group_list covers {ends[-1]} rows, x has {rows}")
    return [0, *ends]


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, output_dtype=None):
    CALLS["npu_grouped_matmul"] = CALLS.get("npu_grouped_matmul", 0) + 1
    if any(a is not None for a in (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale)):
        raise NotImplementedError("npu_grouped_matmul (FAKE): only the plain (non-quantised, no bias) form")
    if len(x) == 1 and len(weight) == 1 and weight[0].dim() == 3:
        if not isinstance(group_list, torch.Tensor) or group_type != 0:
            raise RuntimeError("npu_grouped_matmul (FAKE): one 3-D weight needs a tensor group_list and group_type=0")
    weights = list(weight[0].unbind(0)) if len(weight) == 1 and weight[0].dim() == 3 else list(weight)
    if len(x) == 1:
        bounds = _offsets(group_list, group_list_type, x[0].shape[0])
        parts = [x[0][bounds[i]:bounds[i + 1]] for i in range(len(weights))]
    else:
        parts = list(x)
    outputs = [part @ w for part, w in zip(parts, weights)]
    return [torch.cat(outputs)] if split_item in (2, 3) else outputs
