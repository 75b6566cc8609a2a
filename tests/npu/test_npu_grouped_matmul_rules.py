"""grouped_matmul's NPU path under torch_npu's documented npu_grouped_matmul rules, on the FAKE npu (which enforces
them): the cumulative int64 group_list (group_list_type=0), one local expert as a plain matmul, the backward through
npu_grouped_matmul (dx: group_type=0 over the transposed weights, dw: group_type=2) with no host sync, older
op-plugin releases (MM_ADAPTOR_FAKE_NPU_OP_PLUGIN), and the fake refusing each documented misuse."""

import pytest

from tests.npu.fake import TRY_EACH_CALL, assert_refusals, run_python

pytestmark = pytest.mark.npu

PRELUDE = r"""
import json, os, sys, warnings, torch, torch_npu
sys.path.insert(0, os.getcwd())
from mm_adaptor import devices
devices.install("npu")
import importlib
gm = importlib.import_module("mm_adaptor.ops.grouped_matmul")
FAKE = os.path.dirname(torch_npu.__file__)
SYNCS = []  # host reads of npu tensors outside the fake's own kernels


def _counting(name, original, moves_to_host):
    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        caller = sys._getframe(1).f_code.co_filename
        on_npu = isinstance(self, torch.Tensor) and self.device.type == "npu"
        if on_npu and not caller.startswith(FAKE) and moves_to_host(result):
            SYNCS.append(f"{name} at {caller}:{sys._getframe(1).f_lineno}")
        return result
    return wrapper


for name in ("tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__"):
    setattr(torch.Tensor, name, _counting(name, getattr(torch.Tensor, name), lambda r: True))
for name in ("cpu", "to"):
    setattr(torch.Tensor, name, _counting(name, getattr(torch.Tensor, name),
                                          lambda r: isinstance(r, torch.Tensor) and r.device.type == "cpu"))
CALLS = torch_npu.ops.CALLS


def gmm_calls():
    return {k: v for k, v in CALLS.items() if k.startswith("npu_grouped_matmul")}


def delta(before):
    return {k: v - before.get(k, 0) for k, v in gmm_calls().items() if v != before.get(k, 0)}


def case(counts, dtype, counts_on_npu, seed=0):
    torch.manual_seed(seed)
    x, w = torch.randn(sum(counts), 8, dtype=torch.float64), torch.randn(len(counts), 8, 4, dtype=torch.float64)
    dy = torch.randn(sum(counts), 4, dtype=torch.float64)
    tokens = torch.tensor(counts)
    xn, wn = x.to(dtype).to("npu").requires_grad_(), w.to(dtype).to("npu").requires_grad_()
    out = {}
    try:
        del SYNCS[:]
        before = gmm_calls()
        y = gm.grouped_matmul(xn, wn, tokens.to("npu") if counts_on_npu else tokens)
        out["fwd_calls"], before = delta(before), gmm_calls()
        y.backward(dy.to(dtype).to("npu"))
        out["bwd_calls"], out["syncs"] = delta(before), list(SYNCS)
    except Exception as exc:  # the old code's calls, refused by the fake
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    xr, wr = x.to(dtype).double().requires_grad_(), w.to(dtype).double().requires_grad_()
    gm.reference_fwd(xr, wr, tokens).backward(dy.to(dtype).double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = lambda a, b: float((a.detach().cpu().double() - b).abs().max() / b.abs().max().clamp_min(1e-30))
    out["errors"] = [err(y, gm.reference_fwd(x.to(dtype).double(), w.to(dtype).double(), tokens)),
                     err(xn.grad, xr.grad), err(wn.grad, wr.grad)]
    out["ok"] = all(e <= tol for e in out["errors"]) and str(y.device) == "npu:0"
    return out
"""

CASES = PRELUDE + r"""
results = {}
for dtype in (torch.float32, torch.bfloat16):
    d = str(dtype).split(".")[-1]
    results[f"one_local_expert_{d}"] = case([6], dtype, counts_on_npu=True)
    results[f"zero_token_experts_{d}"] = case([3, 0, 5, 0], dtype, counts_on_npu=True)
    results[f"host_counts_{d}"] = case([1, 2, 3], dtype, counts_on_npu=False)
results["float64"] = case([3, 0, 5], torch.float64, counts_on_npu=False)
print("RESULT=" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def master():
    return run_python(CASES, devices=1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_local_expert_is_a_plain_matmul_equal_to_the_reference_without_host_sync(master, dtype):
    """EP with one local expert per rank: torch_npu refuses a count group_list (group_list_type=1) of length 1,
    which the old forward passed; a plain matmul needs no group list at all."""
    r = master[f"one_local_expert_{dtype}"]
    assert r.get("ok"), r
    assert r["fwd_calls"] == {} and r["bwd_calls"] == {} and r["syncs"] == [], r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("counts", ["zero_token_experts", "host_counts"])
def test_forward_and_backward_run_npu_grouped_matmul_without_host_sync(master, dtype, counts):
    """Forward: one group_type=0 call; backward: dx by group_type=0 and dw by group_type=2 (the old backward ran
    the reference's per-expert loop). Counts on the device stay there; host counts are read on the host only.
    Zero-token experts get zero weight gradients although the fake leaves an empty k group's block NaN."""
    r = master[f"{counts}_{dtype}"]
    assert r.get("ok"), r
    assert r["fwd_calls"] == {"npu_grouped_matmul": 1, "npu_grouped_matmul:group_type=0": 1}, r
    assert r["bwd_calls"] == {"npu_grouped_matmul": 2, "npu_grouped_matmul:group_type=0": 1,
                              "npu_grouped_matmul:group_type=2": 1}, r
    assert r["syncs"] == [], r


def test_float64_which_torch_npu_does_not_take_runs_the_reference(master):
    r = master["float64"]
    assert r.get("ok") and r["fwd_calls"] == {} and r["bwd_calls"] == {}, r


OLDER = PRELUDE + r"""
results = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    results["first"] = case([3, 0, 5, 0], torch.float32, counts_on_npu=True)
    results["second"] = case([2, 2, 0, 1], torch.float32, counts_on_npu=False, seed=1)
    results["one_local_expert"] = case([6], torch.float32, counts_on_npu=True)
results["warnings"] = sorted({str(w.message) for w in caught if "grouped_matmul on NPU" in str(w.message)})
print("RESULT=" + json.dumps(results))
"""


@pytest.mark.parametrize("release", ["7.0.0", "7.1.0"])
def test_without_k_axis_groups_the_weight_gradient_runs_per_expert(release):
    """op-plugin 7.1.0 refuses group_type=2 (7.2.0 added it) and 7.0.0 does not check it: 7.1.0 is tried once and
    remembered, 7.0.0 (its schema has no tuning_config) is never sent group_type=2; dx stays on the kernel."""
    r = run_python(OLDER, devices=1, MM_ADAPTOR_FAKE_NPU_OP_PLUGIN=release)
    for name in ("first", "second", "one_local_expert"):
        assert r[name].get("ok"), (name, r[name])
    tried = {"npu_grouped_matmul:group_type=2": 1} if release == "7.1.0" else {}
    assert r["first"]["bwd_calls"] == {"npu_grouped_matmul": 1 + len(tried), "npu_grouped_matmul:group_type=0": 1,
                                       **tried}, r["first"]
    assert r["second"]["bwd_calls"] == {"npu_grouped_matmul": 1, "npu_grouped_matmul:group_type=0": 1}, r["second"]
    assert len(r["warnings"]) == 1 and "group_type=2" in r["warnings"][0], r["warnings"]


def test_torch_npu_without_tensor_group_list_runs_the_reference():
    """op-plugin 6.0.0 (torch_npu for torch 2.4 among others) has only the int[] group_list, which takes neither
    zero-token experts nor one expert: the reference runs, with one warning; the old call's keywords are refused."""
    source = OLDER.replace('print("RESULT="', r"""
try:
    torch_npu.npu_grouped_matmul([torch.ones(2, 2, device="npu")], [torch.ones(1, 2, 2, device="npu")],
                                 group_list=torch.tensor([2], device="npu"), group_type=0, split_item=3)
    results["tensor_group_list"] = "accepted"
except Exception as exc:
    results["tensor_group_list"] = str(exc)
print("RESULT=" """, 1)
    r = run_python(source, devices=1, MM_ADAPTOR_FAKE_NPU_OP_PLUGIN="6.0.0")
    for name in ("first", "second"):
        assert r[name].get("ok") and r[name]["fwd_calls"] == {} and r[name]["bwd_calls"] == {}, (name, r[name])
    assert len(r["warnings"]) == 1 and "no tensor group_list" in r["warnings"][0], r["warnings"]
    assert r["tensor_group_list"] != "accepted"


RULES = r"""
import json, torch, torch_npu
gmm = torch_npu.npu_grouped_matmul
x, w = torch.randn(6, 4, device="npu"), torch.randn(3, 4, 5, device="npu")
gl = lambda *v, **kw: torch.tensor(v, dtype=kw.get("dtype", torch.int64), device=kw.get("device", "npu"))
m = dict(group_type=0, split_item=3)
calls = {
    "counts_of_length_1": lambda: gmm([x], [w[:1]], group_list=gl(6), group_list_type=1, **m),
    "negative_counts": lambda: gmm([x], [w], group_list=gl(3, -1, 4), group_list_type=1, **m),
    "decreasing_cumsum": lambda: gmm([x], [w], group_list=gl(3, 2, 6), group_list_type=0, **m),
    "cumsum_short_of_rows": lambda: gmm([x], [w], group_list=gl(2, 4, 5), group_list_type=0, **m),
    "counts_short_of_rows": lambda: gmm([x], [w], group_list=gl(2, 2, 1), group_list_type=1, **m),
    "int32_group_list": lambda: gmm([x], [w], group_list=gl(2, 4, 6, dtype=torch.int32), **m),
    "host_group_list": lambda: gmm([x], [w], group_list=gl(2, 4, 6, device="cpu"), **m),
    "group_list_type_2": lambda: gmm([x], [w], group_list=gl(2, 4, 6), group_list_type=2, **m),
    "no_group_type": lambda: gmm([x], [w], group_list=gl(2, 4, 6), split_item=3),
    "group_type_1": lambda: gmm([x], [w], group_list=gl(2, 4, 6), group_type=1, split_item=3),
    "split_item_0": lambda: gmm([x.bfloat16()], [w.bfloat16()], group_list=gl(2, 4, 6), group_type=0, split_item=0),
    "float64": lambda: gmm([x.double()], [w.double()], group_list=gl(2, 4, 6), **m),
    "mixed_dtypes": lambda: gmm([x.bfloat16()], [w], group_list=gl(2, 4, 6), **m),
    "transposed_x": lambda: gmm([torch.randn(4, 6, device="npu").t()], [w], group_list=gl(2, 4, 6), **m),
    "over_1024_groups": lambda: gmm([x], [torch.randn(1025, 4, 5, device="npu")],
                                    group_list=gl(*[6] * 1025), **m),
    "inner_limit": lambda: gmm([torch.randn(2, 65536, device="npu")], [torch.randn(2, 65536, 1, device="npu")],
                               group_list=gl(1, 2), **m),
    "list_group_list_with_group_type": lambda: gmm([x], [w[0], w[1], w[2]], group_list=[2, 4, 6], group_type=0,
                                                   split_item=3),
    "list_group_list_not_increasing": lambda: gmm([x], [w[0], w[1], w[2]], group_list=[2, 2, 6], split_item=3),
    "k_groups_x_not_transposed": lambda: gmm([torch.randn(4, 6, device="npu")], [torch.randn(6, 5, device="npu")],
                                             group_list=gl(2, 6), group_type=2, split_item=3),
    "k_groups_3d_weight": lambda: gmm([torch.randn(6, 4, device="npu").t()], [w], group_list=gl(2, 6),
                                      group_type=2, split_item=3),
    "fine_cumsum": lambda: gmm([x], [w], group_list=gl(2, 2, 6), **m),
    "fine_counts": lambda: gmm([x], [w], group_list=gl(2, 0, 4), group_list_type=1, **m),
    "fine_transposed_weight": lambda: gmm([x], [torch.randn(3, 5, 4, device="npu").transpose(1, 2)],
                                          group_list=gl(2, 2, 6), **m),
}
""" + TRY_EACH_CALL + r"""# k-axis groups compute x_e^T @ dy_e; an empty group's block is left NaN (undocumented)
xs, dy = torch.randn(7, 4), torch.randn(7, 5)
dw = gmm([xs.to("npu").t()], [dy.to("npu")], group_list=gl(3, 3, 7), group_type=2, split_item=3)[0].cpu()
expected = torch.stack([xs[:3].t() @ dy[:3], torch.zeros(4, 5), xs[3:].t() @ dy[3:]])
out["k_groups"] = {"shape": list(dw.shape), "close": torch.allclose(dw[[0, 2]], expected[[0, 2]], atol=1e-5),
                   "empty_nan": bool(dw[1].isnan().all())}
print("RESULT=" + json.dumps(out))
"""

REFUSED = {
    "counts_of_length_1": "cannot have length 1",
    "negative_counts": "non-negative",
    "decreasing_cumsum": "non-decreasing",
    "cumsum_short_of_rows": "must end at",
    "counts_short_of_rows": "must end at",
    "int32_group_list": "1-D int64",
    "host_group_list": "on x's device",
    "group_list_type_2": "int8",
    "no_group_type": "Requires manual passing group_type",
    "group_type_1": "group_type currently only support",
    "split_item_0": "split_item 2 or 3",
    "float64": "float16, bfloat16 or float32",
    "mixed_dtypes": "the same for both",
    "transposed_x": "x cannot be transposed",
    "over_1024_groups": "at most 1024",
    "inner_limit": "below 65536",
    "list_group_list_with_group_type": "tensor group_list",
    "list_group_list_not_increasing": "strictly increasing",
    "k_groups_x_not_transposed": "laid out as [K, M]",
    "k_groups_3d_weight": "one 2-D weight",
}


def test_the_fake_refuses_what_torch_npu_documents_as_refused():
    r = run_python(RULES, devices=1)
    assert_refusals(r, REFUSED, ("fine_cumsum", "fine_counts", "fine_transposed_weight"))
    assert r["k_groups"] == {"shape": [3, 4, 5], "close": True, "empty_nan": True}, r["k_groups"]
