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
    x = torch.randn(sum(counts), 8, dtype=torch.float32)
    w = torch.randn(len(counts), 8, 4, dtype=torch.float32)
    dy = torch.randn(sum(counts), 4, dtype=torch.float32)
    tokens = torch.tensor(counts)
    xn, wn = x.to("npu").requires_grad_(), w.to("npu").requires_grad_()
    y = gm.grouped_matmul(xn, wn, tokens.to("npu"))
    y.backward(dy.to("npu"))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = gm.reference_fwd(xr, wr, tokens)
    yr.backward(dy)
    results[name] = {"device": str(y.device), "fwd": torch.allclose(y.cpu(), yr),
                     "dx": torch.allclose(xn.grad.cpu(), xr.grad),
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


FUSED = r"""
import json, sys, torch, torch_npu
sys.path.insert(0, __import__("os").getcwd())
from mm_adaptor import devices
devices.install("npu")
import importlib
rms, sw, rope = (importlib.import_module(f"mm_adaptor.ops.{m}") for m in ("rms_norm", "swiglu", "rotary_pos_emb"))
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}

def compare(name, fn, ref, inputs, dtype):
    # fn on npu tensors of `dtype` against ref (the op's plain-PyTorch reference) in float64 on the CPU, fwd and bwd
    torch.manual_seed(1)
    npu_in = [t.to(dtype).to("npu").requires_grad_() for t in inputs[0]]
    y = fn(*npu_in, *inputs[1])
    dy = torch.randn(y.shape, dtype=torch.float64)
    y.backward(dy.to(dtype).to("npu"))
    ref_in = [t.to(dtype).double().requires_grad_() for t in inputs[0]]
    yr = ref(*ref_in, *inputs[1])
    yr.backward(dy.to(dtype).double())
    errors = [float((a.detach().cpu().double() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30))
              for a, b in [(y, yr), *[(t.grad, r.grad) for t, r in zip(npu_in, ref_in)]]]
    return {"device": str(y.device), "ok": all(e <= TOL[dtype] for e in errors), "errors": errors}

torch.manual_seed(0)
results, before = {}, {}
for dtype in (torch.float32, torch.bfloat16, torch.float64):
    d = str(dtype).split(".")[-1]
    before[d] = dict(torch_npu.ops.CALLS)
    x, w = torch.randn(5, 3, 24) * 2, torch.rand(24) + 0.5
    results[f"rms_norm_{d}"] = compare("rms", lambda x, w: rms.rms_norm(x, w, 1e-5),
                                       lambda x, w: rms.reference_fwd(x, w, 1e-5)[0], ([x, w], []), dtype)
    results[f"swiglu_{d}"] = compare("swiglu", sw.swiglu, sw.reference_fwd, ([torch.randn(7, 2, 30)], []), dtype)
    for interleaved in (False, True):
        for rot in (16, 10):  # all channels rotated, and partial rotary
            t, freqs = torch.randn(6, 2, 3, 16), torch.rand(6, 1, 1, rot) * 6
            if interleaved:
                freqs = freqs[..., ::2].repeat_interleave(2, -1)
            else:
                freqs = torch.cat([freqs[..., : rot // 2]] * 2, -1)
            results[f"rope_{'interleave' if interleaved else 'half'}_{rot}_{d}"] = compare(
                "rope", lambda t: rope.rotary_pos_emb(t, freqs.to("npu"), interleaved),
                lambda t: rope.reference_fwd(t, freqs.double(), interleaved), ([t], []), dtype)
after = dict(torch_npu.ops.CALLS)
calls = {d: {k: after.get(k, 0) - before[d].get(k, 0) for k in after} for d in before}
print("RESULT=" + json.dumps({"results": results, "calls_from_float32": calls["float32"], "calls": after,
                              "float64_calls": {k: v for k, v in after.items() if v != before["float64"].get(k, 0)}}))
"""


def test_fused_op_npu_paths_use_torch_npus_forward_and_backward_kernels_and_match_references():
    r = run_python(FUSED, devices=1)
    for name, result in r["results"].items():
        assert result["device"] == "npu:0" and result["ok"], (name, result)
    calls = r["calls"]
    # float32 and bfloat16 ran torch_npu's kernels, forward and backward, both rotary modes (not the reference)
    for op in ("npu_rms_norm", "npu_rms_norm_backward", "npu_swiglu", "npu_swiglu_backward", "npu_rotary_mul:half",
               "npu_rotary_mul_backward:half", "npu_rotary_mul:interleave", "npu_rotary_mul_backward:interleave"):
        assert calls.get(op, 0) >= 2, (op, calls)
    # float64, which torch_npu documents no kernel for, ran the references
    assert r["float64_calls"] == {}, r["float64_calls"]


ATTENTION = r"""
import json, sys, warnings, torch, torch_npu
sys.path.insert(0, __import__("os").getcwd())
from mm_adaptor import devices
devices.install("npu")
import importlib
attention = importlib.import_module("mm_adaptor.ops.attention")

def case(sq, sk, hq, hkv, causal, mask, dtype=torch.float32, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    q, k, v = torch.randn(sq, 2, hq, 8), torch.randn(sk, 2, hkv, 8), torch.randn(sk, 2, hkv, 8)
    dy = torch.randn(sq, 2, hq, 8)
    npu = [t.to(dtype).to("npu").requires_grad_() for t in (q, k, v)]
    torch.npu.manual_seed(5)
    y = attention.flash_attention(*npu, causal=causal, attention_mask=None if mask is None else mask.to("npu"),
                                  scale=0.3, dropout_p=dropout)
    y.backward(dy.to(dtype).to("npu"))
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    yr = attention.BlockwiseAttention.apply(*ref, mask, causal, 0.3, 0.0)
    yr.backward(dy.double())
    pairs = [(y, yr), *[(a.grad, b.grad) for a, b in zip(npu, ref)]]
    err = max(float((a.detach().cpu().double() - b.detach()).abs().max()) for a, b in pairs)
    return {"device": str(y.device), "err": err, "out": y.detach().cpu().double(), "dq": npu[0].grad.cpu().double()}

calls, out = torch_npu.ops.CALLS, {}
padding = torch.zeros(2, 1, 1, 6, dtype=torch.bool); padding[1, ..., 4:] = True
rows = torch.zeros(2, 1, 6, 6, dtype=torch.bool); rows[0, :, 2, :] = True  # one row with every key masked
cases = {"causal_gqa": (6, 6, 4, 2, True, None), "causal_sq_lt_sk": (4, 6, 2, 2, True, None),
         "causal_sq_gt_sk": (6, 4, 2, 1, True, None), "padding_causal": (6, 6, 2, 2, True, padding),
         "fully_masked_row": (6, 6, 2, 2, False, rows), "no_mask": (5, 7, 2, 2, False, None)}
for name, args in cases.items():
    before = dict(calls)
    r = case(*args)
    out[name] = {"device": r["device"], "err": r["err"],
                 "fusion": calls.get("npu_fusion_attention", 0) - before.get("npu_fusion_attention", 0),
                 "grad": calls.get("npu_fusion_attention_grad", 0) - before.get("npu_fusion_attention_grad", 0)}
out["bf16_err"] = case(6, 6, 4, 2, True, None, dtype=torch.bfloat16)["err"]
plain, drop1, drop2 = (case(6, 6, 2, 2, True, None, dropout=p) for p in (0.0, 0.3, 0.3))
out["dropout"] = {"differs": not torch.equal(plain["out"], drop1["out"]),
                  "repeats": torch.equal(drop1["out"], drop2["out"]) and torch.equal(drop1["dq"], drop2["dq"])}
before = calls.get("npu_fusion_attention", 0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out["fp64_err"] = case(6, 6, 2, 2, True, None, dtype=torch.float64)["err"]
out["fp64_fusion_calls"] = calls.get("npu_fusion_attention", 0) - before
out["fp64_warning"] = [str(w.message) for w in caught if "npu_fusion_attention" in str(w.message)]
before = calls.get("npu_fusion_attention", 0)
with warnings.catch_warnings(record=True):  # keep_prob 0 is outside the kernel's (0, 1]: the blockwise kernel
    warnings.simplefilter("always")
    q = torch.randn(4, 1, 2, 8, device="npu")
    out["all_dropped"] = attention.flash_attention(q, q, q, dropout_p=1.0).abs().max().item()
out["all_dropped_fusion_calls"] = calls.get("npu_fusion_attention", 0) - before
print("RESULT=" + json.dumps(out))
"""


def test_flash_attention_on_npu_runs_npu_fusion_attention_and_matches_the_reference():
    r = run_python(ATTENTION, devices=1)
    for name in ("causal_gqa", "causal_sq_lt_sk", "causal_sq_gt_sk", "padding_causal", "fully_masked_row", "no_mask"):
        assert r[name]["device"] == "npu:0" and r[name]["err"] < 1e-5, (name, r[name])
        assert r[name]["fusion"] == 1 and r[name]["grad"] == 1, (name, r[name])  # torch_npu's kernel, fwd and bwd
    assert r["bf16_err"] < 5e-2
    # dropout from the npu generator: the same seed repeats the masks, forward and backward
    assert r["dropout"] == {"differs": True, "repeats": True}
    # float64, which npu_fusion_attention does not take: the blockwise kernel, with a warning saying so
    assert r["fp64_err"] < 1e-12 and r["fp64_fusion_calls"] == 0 and len(r["fp64_warning"]) == 1
    assert r["all_dropped"] == 0.0 and r["all_dropped_fusion_calls"] == 0


HOST_MAPPED = r"""
import json, sys, torch, torch_npu
sys.path.insert(0, __import__("os").getcwd())
from mm_adaptor import devices
devices.install("npu")
from mm_adaptor.ops import host_mapped_copy
try:
    host_mapped_copy(torch.ones(4, device="npu")); error = None
except RuntimeError as exc:
    error = str(exc)
print("RESULT=" + json.dumps({"error": error}))
"""


def test_host_mapped_copy_on_npu_refuses_with_torch_npus_swapped_memory_limits():
    """torch_npu's swapped-memory tensors take only fill_, zero_, npu_apply_adam_w (and its hans codecs): the copy
    and the element-wise Adam of the virtual optimizer are not among them, so the NPU path says so instead of
    calling them."""
    error = run_python(HOST_MAPPED, devices=1)["error"]
    assert error and "fill_, zero_, npu_apply_adam_w" in error and "--swap-optimizer" in error
