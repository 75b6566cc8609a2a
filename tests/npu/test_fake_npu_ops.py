"""The NPU op paths on the FAKE npu device match their references forward and backward (the fake's npu_* ops are
reference math with torch_npu's argument rules: this checks the calls, not Ascend kernels)."""

import pytest

from tests.npu.fake import run_python

pytestmark = pytest.mark.npu

GROUPED = r"""
import json, sys, torch, torch_npu
sys.path.insert(0, __import__("os").getcwd())
from mm_adaptor import devices
devices.install("npu")
import importlib; gm = importlib.import_module("mm_adaptor.ops.grouped_matmul")
results = {}
for name, counts in {"zero_token_experts": [3, 0, 5, 0], "single_local_expert": [6], "uneven": [1, 2, 3]}.items():
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 8, dtype=torch.float64)
    w = torch.randn(len(counts), 8, 4, dtype=torch.float64)
    dy = torch.randn(sum(counts), 4, dtype=torch.float64)
    tokens = torch.tensor(counts)
    xn, wn = x.to("npu").requires_grad_(), w.to("npu").requires_grad_()
    y = gm.grouped_matmul(xn, wn, tokens.to("npu"))
    y.backward(dy.to("npu"))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = gm.reference_fwd(xr, wr, tokens)
    yr.backward(dy)
    results[name] = {"device": str(y.device), "fwd": torch.allclose(y.cpu(), yr), "dx": torch.allclose(xn.grad.cpu(), xr.grad),
                     "dw": torch.allclose(wn.grad.cpu(), wr.grad)}
try:
    torch_npu.npu_grouped_matmul([x.to("npu")], [w.to("npu")], group_list=[3, 3, 8, 8], group_type=0)
    results["list_group_list"] = "accepted"
except RuntimeError as e:
    results["list_group_list"] = str(e)
results["calls"] = torch_npu.ops.CALLS.get("npu_grouped_matmul", 0)
print("RESULT=" + json.dumps(results))
"""


def test_grouped_matmul_on_npu_matches_reference_with_zero_token_and_single_experts():
    r = run_python(GROUPED, devices=1)
    for name in ("zero_token_experts", "single_local_expert", "uneven"):
        assert r[name] == {"device": "npu:0", "fwd": True, "dx": True, "dw": True}, (name, r[name])
    assert r["calls"] >= 3  # the NPU path (torch_npu.npu_grouped_matmul) ran, not the reference
    assert "strictly increasing" in r["list_group_list"] or "tensor group_list" in r["list_group_list"]
