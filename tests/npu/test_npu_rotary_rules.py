"""rotary_pos_emb's NPU path under torch_npu's documented npu_rotary_mul limits, on the FAKE npu (which enforces
them): beyond them the reference runs and gives the same numbers; torch_npu without rotary_mode (op-plugin 6.0.0,
its three-argument schema) is served in rotate-half; the fake refuses each documented misuse."""

import pytest

from tests.npu.fake import TRY_EACH_CALL, assert_refusals, run_python

pytestmark = pytest.mark.npu

PRELUDE = r"""
import json, os, sys, torch, torch_npu
sys.path.insert(0, os.getcwd())
from mm_adaptor import devices
devices.install("npu")
import importlib
rope = importlib.import_module("mm_adaptor.ops.rotary_pos_emb")
CALLS = torch_npu.ops.CALLS


def rotary_calls(before):
    return {k: v - before.get(k, 0) for k, v in CALLS.items() if k.startswith("npu_rotary_mul")
            and v != before.get(k, 0)}


def case(shape, rot, interleaved, dtype=torch.float32):
    # rotary_pos_emb on the npu, forward and backward, against the reference in float64 on the host
    torch.manual_seed(0)
    t, dy = torch.randn(shape), torch.randn(shape)
    freqs = torch.rand(shape[0], *[1] * (len(shape) - 2), rot) * 6
    tn = t.to(dtype).to("npu").requires_grad_()
    before, out = dict(CALLS), {}
    try:
        y = rope.rotary_pos_emb(tn, freqs.to("npu"), interleaved)
        out["fwd_calls"], before = rotary_calls(before), dict(CALLS)
        y.backward(dy.to(dtype).to("npu"))
        out["bwd_calls"] = rotary_calls(before)
    except Exception as exc:  # the old code's calls, refused by the fake
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    tr = t.to(dtype).double().requires_grad_()
    yr = rope.reference_fwd(tr, freqs.double(), interleaved)
    yr.backward(dy.to(dtype).double())
    err = lambda a, b: float((a.detach().cpu().double() - b.detach()).abs().max() / b.detach().abs().max())
    out["errors"] = [err(y, yr), err(tn.grad, tr.grad)]
    out["ok"] = all(e < (2e-5 if dtype == torch.float32 else 2e-2) for e in out["errors"])
    return out
"""

LIMITS = PRELUDE + r"""
results = {
    "within": case((6, 2, 3, 16), 16, False),
    "within_interleave": case((6, 2, 3, 16), 16, True),
    "half_n_1000": case((2, 1, 1000, 8), 8, False),  # half mode: B < 1000 and N < 1000
    "half_b_1000": case((2, 1000, 1, 8), 8, False),
    "half_bwd_bn_1200": case((2, 40, 30, 8), 8, False),  # B*N <= 1024 where the cos/sin gradients are computed
    "interleave_bn_1000": case((2, 40, 25, 8), 8, True),  # interleave mode: B*N < 1000
    "tnd_interleave_n_1000": case((3, 1000, 8), 8, True),
    "cos_sin_over_positions_and_batch": None,
}
# per-sample cos/sin ([s, b, 1, d]): not megatron's [s, 1, 1, d], the reference runs
torch.manual_seed(0)
t, freqs = torch.randn(4, 2, 3, 8), torch.rand(4, 2, 1, 8)
before = dict(CALLS)
y = rope.rotary_pos_emb(t.to("npu"), freqs.to("npu"), False)
results["cos_sin_over_positions_and_batch"] = {
    "calls": rotary_calls(before), "ok": torch.allclose(y.cpu(), rope.reference_fwd(t, freqs, False), atol=1e-6)}
print("RESULT=" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def limits():
    return run_python(LIMITS, devices=1)


def test_within_the_limits_npu_rotary_mul_serves_forward_and_backward(limits):
    for name, mode in (("within", "half"), ("within_interleave", "interleave")):
        r = limits[name]
        assert r.get("ok") and r["fwd_calls"] == {f"npu_rotary_mul:{mode}": 1}, (name, r)
        assert r["bwd_calls"] == {f"npu_rotary_mul_backward:{mode}": 1}, (name, r)


@pytest.mark.parametrize("name", ["half_n_1000", "half_b_1000", "interleave_bn_1000", "tnd_interleave_n_1000"])
def test_beyond_the_limits_the_reference_runs_and_matches(limits, name):
    """The old path called npu_rotary_mul there, which torch_npu documents as unsupported (the fake refuses)."""
    r = limits[name]
    assert r.get("ok") and r["fwd_calls"] == {} and r["bwd_calls"] == {}, r


def test_backward_beyond_b_times_n_1024_runs_the_reference(limits):
    """B=40, N=30: the forward is within half mode's limits, the backward (which computes the cos/sin gradients
    too) is not."""
    r = limits["half_bwd_bn_1200"]
    assert r.get("ok") and r["fwd_calls"] == {"npu_rotary_mul:half": 1} and r["bwd_calls"] == {}, r


def test_cos_sin_varying_over_the_batch_take_the_reference(limits):
    assert limits["cos_sin_over_positions_and_batch"] == {"calls": {}, "ok": True}


THREE_ARGS = PRELUDE + r"""
results = {
    "takes_rotary_mode": getattr(rope, "takes_rotary_mode", lambda: None)(),
    "half_d128": case((4, 2, 3, 128), 128, False),
    "half_d128_bf16": case((4, 2, 3, 128), 128, False, torch.bfloat16),
    "partial_d128": case((4, 2, 3, 160), 128, False),
    "interleave": case((4, 2, 3, 128), 128, True),
    "half_d64": case((4, 2, 3, 64), 64, False),
    "broadcast_over_1024": case((2, 40, 30, 128), 128, False),
}
x, r1 = torch.randn(4, 2, 3, 128, device="npu"), torch.rand(4, 1, 1, 128, device="npu")
for name, call in {"four_arguments": lambda: torch_npu.npu_rotary_mul(x, r1, r1, "half"),
                   "d64": lambda: torch_npu.npu_rotary_mul(x[..., :64], r1[..., :64], r1[..., :64]),
                   "three_dims": lambda: torch_npu.npu_rotary_mul(x[0], r1[0], r1[0]),
                   "broadcast": lambda: torch_npu.npu_rotary_mul(torch.randn(2, 40, 30, 128, device="npu"),
                                                                 r1[:2], r1[:2]),
                   "bnsd_bn_over_8s": lambda: torch_npu.npu_rotary_mul(torch.randn(4, 8, 2, 128, device="npu"),
                                                                       r1[:2].view(1, 1, 2, 128),
                                                                       r1[:2].view(1, 1, 2, 128))}.items():
    try:
        call()
        results[name] = "accepted"
    except Exception as exc:
        results[name] = str(exc)
print("RESULT=" + json.dumps(results))
"""


def test_torch_npu_without_rotary_mode_serves_rotate_half_with_three_arguments():
    """op-plugin 6.0.0 (torch_npu for torch 2.4 among others): npu_rotary_mul(self, r1, r2), rotate-half, 4-D,
    D = 128. Read from the schema: the four-argument call, which the old path made, is never tried."""
    r = run_python(THREE_ARGS, devices=1, MM_ADAPTOR_FAKE_NPU_OP_PLUGIN="6.0.0")
    assert r["takes_rotary_mode"] is False
    for name in ("half_d128", "half_d128_bf16", "partial_d128"):
        assert r[name].get("ok") and r[name]["fwd_calls"] == {"npu_rotary_mul:half": 1}, (name, r[name])
        assert r[name]["bwd_calls"] == {"npu_rotary_mul_backward:half": 1}, (name, r[name])
    for name in ("interleave", "half_d64", "broadcast_over_1024"):
        assert r[name].get("ok") and r[name]["fwd_calls"] == {} and r[name]["bwd_calls"] == {}, (name, r[name])
    assert r["four_arguments"] != "accepted"
    assert "D = 128" in r["d64"] and "4 supported" in r["three_dims"], r
    assert "more than 1024" in r["broadcast"] and "B*N > 8*S" in r["bnsd_bn_over_8s"], r


RULES = r"""
import json, torch, torch_npu
mul, bwd = torch_npu.npu_rotary_mul, torch_npu.npu_rotary_mul_backward
x = lambda *shape: torch.randn(*shape, device="npu")
r = lambda *shape: torch.rand(*shape, device="npu")
calls = {
    "half_n_1000": lambda: mul(x(2, 1, 1000, 8), r(2, 1, 1, 8), r(2, 1, 1, 8)),
    "half_b_1000": lambda: mul(x(2, 1000, 1, 8), r(2, 1, 1, 8), r(2, 1, 1, 8), "half"),
    "interleave_bn_1000": lambda: mul(x(2, 40, 25, 8), r(2, 1, 1, 8), r(2, 1, 1, 8), "interleave"),
    "backward_bn_1025": lambda: bwd(x(2, 41, 25, 8), x(2, 41, 25, 8), r(2, 1, 1, 8), r(2, 1, 1, 8), "half"),
    "interleave_cos_over_batch": lambda: mul(x(2, 3, 4, 8), r(2, 3, 1, 8), r(2, 3, 1, 8), "interleave"),
    "cos_fits_no_layout": lambda: mul(x(2, 3, 4, 8), r(1, 3, 4, 8), r(1, 3, 4, 8)),
    "cos_out_of_range": lambda: mul(x(2, 3, 4, 8), r(2, 1, 1, 8) + 1.5, r(2, 1, 1, 8)),
    "d_896": lambda: mul(x(2, 3, 4, 896), r(2, 1, 1, 896), r(2, 1, 1, 896)),
    "fine_half_b_bn_1200": lambda: mul(x(2, 40, 30, 8), r(2, 1, 1, 8), r(2, 1, 1, 8)),
    "fine_half_sb1d": lambda: mul(x(2, 3, 4, 8), r(2, 3, 1, 8), r(2, 3, 1, 8)),
    "fine_backward_bn_1024": lambda: bwd(x(2, 32, 32, 8), x(2, 32, 32, 8), r(2, 1, 1, 8), r(2, 1, 1, 8)),
    "fine_tnd": lambda: mul(x(5, 3, 8), r(5, 1, 8), r(5, 1, 8), "interleave"),
}
""" + TRY_EACH_CALL + r"""print("RESULT=" + json.dumps(out))
"""

REFUSED = {
    "half_n_1000": "half mode needs B < 1000 and N < 1000",
    "half_b_1000": "half mode needs B < 1000 and N < 1000",
    "interleave_bn_1000": "interleave mode needs B*N < 1000",
    "backward_bn_1025": "B*N must be <= 1024",
    "interleave_cos_over_batch": "fit no documented layout",
    "cos_fits_no_layout": "fit no documented layout",
    "cos_out_of_range": "outside [-1, 1]",
    "d_896": "below 896",
}


def test_the_fake_refuses_what_torch_npu_documents_as_refused():
    r = run_python(RULES, devices=1)
    assert_refusals(r, REFUSED, ("fine_half_b_bn_1200", "fine_half_sb1d", "fine_backward_bn_1024", "fine_tnd"))
