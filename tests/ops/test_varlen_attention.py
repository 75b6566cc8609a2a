"""varlen_attention against dense attention computed segment by segment (its score matrix, the mask, softmax),
forward, log-sum-exp and backward (with a log-sum-exp gradient too), on random segment lengths with length-1 and
empty segments, grouped-query heads, causal or not, windows, self- and cross-attention lengths.

Tolerances (max abs and rel error against the dense reference in float64 of the same inputs): float64 1e-10;
float32 1e-5; bfloat16 2e-2 on outputs and gradients (one bf16 rounding of an fp32-accumulated result). The
native CPU kernel and the op's plain-PyTorch reference are both checked; broken variants (a query that sees the
next segment's first key, a causal mask one key too wide) must fail the same comparison. opcheck: tests/ops/test_ops.py.
"""

import importlib

import pytest
import torch

from mm_adaptor.ops import library, varlen_attention, varlen_attention_with_lse
from mm_adaptor.ops.library import ensure

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}
HQ, HK, D = 4, 2, 8
LENGTHS_Q = [1, 9, 1, 0, 14, 5, 2]
LENGTHS_K = [3, 9, 1, 2, 11, 7, 2]  # cross attention: some segments with fewer keys than queries
WINDOWS = [None, (3, 0), (2, 1)]
module = importlib.import_module("mm_adaptor.ops.varlen_attention")  # the package exports the function by that name


@pytest.fixture(scope="module", autouse=True)
def native_cpu():
    state = ensure("cpu")
    assert state["native"], f"the native CPU ops did not build: {state['why']}"


def cumulative(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def dense(q, k, v, cu_q, cu_k, causal, window, scale, leak=False, causal_slack=0):
    """Segment by segment over the full score matrix, in float64. leak: each query also sees the first key after
    its segment; causal_slack: the causal mask lets each query see that many keys past its diagonal."""
    q, k, v = (t.double().repeat_interleave(HQ // t.shape[1], 1) for t in (q, k, v))
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()), zip(cu_k[:-1].tolist(),
                                                                                 cu_k[1:].tolist())):
        sq, sk = q1 - q0, k1 - k0
        extra = 1 if leak and k1 < k.shape[0] else 0
        i = torch.arange(sq).view(-1, 1) + sk - sq
        j = torch.arange(sk + extra).view(1, -1)
        keep = torch.ones(sq, sk + extra, dtype=torch.bool)
        if causal:
            keep &= j <= i + causal_slack
        if window is not None:
            keep &= (j >= i - window[0]) & (j <= i + window[1])
        if extra:
            keep[:, sk:] = True
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1], k[k0:k1 + extra]) * scale
        scores = scores.masked_fill(~keep, float("-inf"))
        lse = scores.logsumexp(-1)
        probs = torch.exp(scores - lse.unsqueeze(-1).nan_to_num(neginf=0.0)).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v[k0:k1 + extra]))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def inputs(dtype, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_Q, seed=0):
    generator = torch.Generator().manual_seed(seed)
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    q = torch.randn(int(cu_q[-1]), HQ, D, generator=generator).to(dtype).requires_grad_()
    k = torch.randn(int(cu_k[-1]), HK, D, generator=generator).to(dtype).requires_grad_()
    v = torch.randn(int(cu_k[-1]), HK, D, generator=generator).to(dtype).requires_grad_()
    return q, k, v, cu_q, cu_k


def gradients(out, lse, q, k, v, seed=1):
    generator = torch.Generator().manual_seed(seed)
    g_out = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=generator, dtype=torch.float64)
    loss = (out.double() * g_out).sum() + (lse.double().nan_to_num(neginf=0.0) * g_lse).sum()
    return torch.autograd.grad(loss, (q, k, v))


def run_op(q, k, v, cu_q, cu_k, causal, window):
    return varlen_attention_with_lse(q, k, v, cu_q, cu_k, int(cu_q.diff().max()), int(cu_k.diff().max()),
                                     causal=causal, window=window)


def run_reference(q, k, v, cu_q, cu_k, causal, window):
    """The op's plain-PyTorch forward and backward, wired as its registered autograd wires the kernels."""
    left, right = module._window(window)
    args = (cu_q, cu_k, 0, 0, causal, D ** -0.5, left, right)

    class Reference(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = module.reference_fwd(q, k, v, *args)
            ctx.save_for_backward(q, k, v, out, lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            return module.reference_bwd(dout, dlse, *ctx.saved_tensors, *args)

    return Reference.apply(q, k, v)


def compare(actual, expected, dtype):
    for a, e in zip(actual, expected):
        finite = torch.isfinite(e)
        assert torch.equal(finite, torch.isfinite(a)), "rows without keys differ"
        torch.testing.assert_close(a.double()[finite], e.double()[finite], rtol=TOL[dtype], atol=TOL[dtype])


def check(run, dtype, causal, window, lengths_k=LENGTHS_Q, **broken):
    q, k, v, cu_q, cu_k = inputs(dtype, LENGTHS_Q, lengths_k)
    out, lse = run(q, k, v, cu_q, cu_k, causal, window)
    assert out.dtype == dtype and lse.dtype == library.accumulation_dtype(q) and lse.shape == (HQ, q.shape[0])
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = dense(qd, kd, vd, cu_q, cu_k, causal, window, D ** -0.5, **broken)
    compare((out, lse), (ref_out, ref_lse), dtype)
    compare(gradients(out, lse, q, k, v), gradients(ref_out, ref_lse, qd, kd, vd), dtype)


@pytest.mark.parametrize("run", [run_op, run_reference], ids=["native", "reference"])
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_matches_dense_attention_per_segment(run, dtype, causal, window):
    check(run, dtype, causal, window)


@pytest.mark.parametrize("run", [run_op, run_reference], ids=["native", "reference"])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, (2, 0)), (False, (1, 2))])
def test_cross_attention_lengths_align_bottom_right(run, causal, window):
    check(run, torch.float64, causal, window, lengths_k=LENGTHS_K)


@pytest.mark.parametrize("broken", [{"leak": True}, {"causal_slack": 1}], ids=["next-segment-key", "causal+1"])
@pytest.mark.parametrize("run", [run_op, run_reference], ids=["native", "reference"])
def test_comparison_rejects_a_broken_mask(run, broken):
    with pytest.raises(AssertionError):
        check(run, torch.float64, True, None, **broken)


def test_native_cpu_kernel_serves_the_op():
    assert "varlen_attention.cpp" in torch._C._dispatch_dump("mm_adaptor::varlen_attention_fwd")
    assert "varlen_attention.cpp" in torch._C._dispatch_dump("mm_adaptor::varlen_attention_bwd")


def test_saves_no_score_matrix():
    """One 2048-token segment: what autograd keeps is q, k, v, out, lse and the lengths (O(T * H * D))."""
    t = 2048
    q, k, v = (torch.randn(t, 1, 4, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, t], dtype=torch.int32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel() * x.element_size()) or x,
                                                  lambda x: x):
        out = varlen_attention(q, k, v, cu, cu, t, t, causal=True)
    assert sum(saved) <= 5 * q.numel() * 4 + 64 < t * t, saved
    out.sum().backward()
    assert q.grad.abs().sum() > 0


def test_lse_gradient_through_an_augmented_backward():
    """The CUDA path's way of adding the log-sum-exp's gradient to a flash backward that takes none."""
    q, k, v, cu_q, cu_k = inputs(torch.float64)
    args = (cu_q, cu_k, 0, 0, True, D ** -0.5, 3, module.UNLIMITED)
    out, lse = module.reference_fwd(q, k, v, *args)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    expected = module.reference_bwd(dout, dlse, q, k, v, out, lse, *args)
    augmented = module.with_lse_gradient(dout, dlse, q, k, v, out)
    actual = module.reference_bwd(augmented[0], None, *augmented[1:4], augmented[4], lse, *args)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a[..., :D], e, rtol=1e-10, atol=1e-10)
    unaugmented = module.reference_bwd(dout, None, q, k, v, out, lse, *args)
    assert not torch.allclose(unaugmented[0], expected[0], atol=1e-3)


@pytest.mark.parametrize("change,message", [
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()}, "int32"),
    (lambda a: {**a, "k": a["k"][:, :1].repeat(1, 3, 1), "v": a["v"][:, :1].repeat(1, 3, 1)}, "multiple"),
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"] - 1}, "rise from 0"),
    (lambda a: {**a, "max_seqlen_q": 2}, "exceeds max_seqlen"),
    (lambda a: {**a, "window": (-3, 0)}, "window"),
])
def test_refuses_bad_arguments(change, message):
    q, k, v, cu_q, cu_k = inputs(torch.float32)
    arguments = change({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 14,
                        "max_seqlen_k": 14, "window": None})
    with pytest.raises(ValueError, match=message):
        varlen_attention(**arguments, causal=True)


NPU_SCRIPT = r"""
import json, os, sys, warnings
import torch, torch_npu
sys.path.insert(0, os.getcwd())
from torch_npu import fused_ops
from mm_adaptor.ops import varlen_attention_with_lse

warnings.simplefilter("ignore")
CALLS = fused_ops.CALLS
lengths_q, lengths_k = __LQ__, __LK__
cu = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def run(device, dtype, causal, window, hq=4, hk=2, d=8, lq=lengths_q, lk=lengths_q):
    generator = torch.Generator().manual_seed(0)
    cu_q, cu_k = cu(lq), cu(lk)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=generator).to(dtype)
    k, v = (torch.randn(int(cu_k[-1]), hk, d, generator=generator).to(dtype) for _ in range(2))
    g_out, g_lse = torch.randn(q.shape, generator=generator), torch.randn(hq, q.shape[0], generator=generator)
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    out, lse = varlen_attention_with_lse(q, k, v, cu_q.to(device), cu_k.to(device), max(lq), max(lk), causal=causal,
                                         window=window)
    loss = (out.float() * g_out.to(device)).sum() + (lse.float() * g_lse.to(device)).sum()
    return [t.detach().cpu().float() for t in (out, lse, *torch.autograd.grad(loss, (q, k, v)))]


cases = {
    "full": (torch.float32, False, None), "causal": (torch.float32, True, None),
    "causal window": (torch.float32, True, (3, 0)), "window": (torch.float32, False, (2, 1)),
    "bf16 causal": (torch.bfloat16, True, None),
}
result = {}
for name, (dtype, causal, window) in cases.items():
    before = (CALLS.get("npu_fusion_attention", 0), CALLS.get("npu_fusion_attention_grad", 0))
    on_npu, on_cpu = run("npu", dtype, causal, window), run("cpu", dtype, causal, window)
    after = (CALLS.get("npu_fusion_attention", 0), CALLS.get("npu_fusion_attention_grad", 0))
    result[name] = {"errors": [float((a - b).abs().max()) for a, b in zip(on_npu, on_cpu)],
                    "kernel calls": [a - b for a, b in zip(after, before)]}
# a query row without keys (causal, more queries than keys): the reference serves it
before = CALLS.get("npu_fusion_attention", 0)
on_npu = run("npu", torch.float32, True, None, lk=lengths_k)
on_cpu = run("cpu", torch.float32, True, None, lk=lengths_k)
result["rows without keys"] = {"errors": [float((a - b).abs().max()) for a, b in zip(on_npu, on_cpu)],
                               "kernel calls": [CALLS.get("npu_fusion_attention", 0) - before, 0]}

q = torch.randn(6, 2, 8, device="npu")
causal_mask = torch.ones(2048, 2048, dtype=torch.bool, device="npu").triu(1)
attend = lambda **kw: (lambda: torch_npu.npu_fusion_attention(q, q, q, 2, "TND", **kw))
calls = {
    "sizes differ": attend(actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 5, 6]),
    "decreasing": attend(actual_seq_qlen=[4, 2, 6], actual_seq_kvlen=[4, 2, 6]),
    "short of T": attend(actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5]),
    "no lengths": attend(),
    "full mask for causal": attend(actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6], sparse_mode=3,
                                   atten_mask=torch.ones(6, 6, dtype=torch.bool, device="npu").triu(1)),
    "fully masked row": attend(actual_seq_qlen=[3, 6], actual_seq_kvlen=[1, 6], sparse_mode=3, atten_mask=causal_mask),
    "1025 segments": (lambda: torch_npu.npu_fusion_attention(
        torch.randn(1025, 1, 8, device="npu"), *[torch.randn(1025, 1, 8, device="npu")] * 2, 1, "TND",
        actual_seq_qlen=list(range(1, 1026)), actual_seq_kvlen=list(range(1, 1026)))),
    "causal": attend(actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6], sparse_mode=3, atten_mask=causal_mask),
    "band": attend(actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6], sparse_mode=4, atten_mask=causal_mask,
                   pre_tockens=1, next_tockens=0),
}
__TRY_EACH_CALL__
result["calls"] = out
print("RESULT=" + json.dumps(result))
"""


@pytest.mark.npu
def test_npu_fusion_attention_tnd_on_the_fake_npu():
    """The NPU path calls npu_fusion_attention and its grad with layout TND (the FAKE enforcing torch_npu's
    documented rules), equal to the CPU kernel; where it cannot (a query without keys) the reference runs; calls
    that break the rules are refused."""
    from tests.npu.fake import TRY_EACH_CALL, assert_refusals, run_python

    script = NPU_SCRIPT.replace("__LQ__", str(LENGTHS_Q)).replace("__LK__", str(LENGTHS_K))
    result = run_python(script.replace("__TRY_EACH_CALL__", TRY_EACH_CALL), devices=1)
    for name, case in result.items():
        if name == "calls":
            continue
        tolerance = 2e-2 if name.startswith("bf16") else 1e-5
        assert max(case["errors"]) < tolerance, (name, case)
        assert case["kernel calls"] == ([0, 0] if name == "rows without keys" else [1, 1]), (name, case)
    assert_refusals(result["calls"], {
        "sizes differ": "of one size", "decreasing": "must be cumulative", "short of T": "ending at T=6",
        "no lengths": "TND needs",
        "full mask for causal": "triu(ones(2048, 2048), 1)", "fully masked row": "fully masked row",
        "1025 segments": "at most 1024"}, accepted=["causal", "band"])


@pytest.fixture(scope="module")
def megatron_rank():
    from gloo_rank import one_gloo_rank
    from megatron.core import tensor_parallel

    with one_gloo_rank():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield


def vision_tower(family, attention):
    import importlib as imp

    config = imp.import_module(f"mm_adaptor.models.{family}.config")
    vision = imp.import_module(f"mm_adaptor.models.{family}.vision")
    tiny = config.tiny_config()
    return tiny, vision.VisionModel(tiny, config.vision_transformer_config(tiny), attention=attention).train()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vision_tower_on_varlen_equals_dense_masks_and_keeps_no_square(megatron_rank, family):
    """Frames and windows (partial ones too) of an image and a two-frame video: the varlen tower's output and
    parameter gradients equal the dense-mask tower's (1e-5 relative, fp32), and it saves no [.., n, n] tensor, which
    the dense tower (the broken variant here) does in every layer."""
    from mm_adaptor.models.qwen2_5_vl.vision import VarlenCoreAttention

    grid = torch.tensor([[1, 16, 20], [2, 8, 8]])
    n = int(grid.prod(-1).sum())
    results = {}
    for attention in ("varlen", "dense"):
        config, model = vision_tower(family, attention)
        if attention == "dense":
            model.load_state_dict(results["varlen"]["state"])
        pixels = torch.randn(n, config.patch_dim, generator=torch.Generator().manual_seed(0))
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, seen=shapes: seen.append(t.shape) or t, lambda t: t):
            hidden = model(pixels, grid)[0]
        hidden.square().sum().backward()
        cores = [m for m in model.modules() if isinstance(m, VarlenCoreAttention)]
        squares = sum(tuple(shape[-2:]) == (n, n) for shape in shapes)
        results[attention] = {"state": model.state_dict(), "hidden": hidden.detach(), "squares": squares,
                              "cores": len(cores), "grads": {k: p.grad for k, p in model.named_parameters()}}
    varlen, dense = results["varlen"], results["dense"]
    assert varlen["cores"] == config.vision_depth and dense["cores"] == 0
    assert varlen["squares"] == 0 and dense["squares"] >= config.vision_depth, (varlen["squares"], dense["squares"])
    torch.testing.assert_close(varlen["hidden"], dense["hidden"], rtol=1e-5, atol=1e-5)
    for name, grad in varlen["grads"].items():
        torch.testing.assert_close(grad, dense["grads"][name], rtol=1e-5, atol=1e-5 * float(grad.abs().max()))


CUDA_CASES = [(torch.bfloat16, True, None), (torch.bfloat16, False, None), (torch.float16, True, (3, 0)),
              (torch.bfloat16, False, (2, 1)), (torch.float32, True, None)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (scripts/gpu_session.sh runs it on one)")
@pytest.mark.parametrize("dtype,causal,window", CUDA_CASES, ids=str)
def test_cuda_matches_dense_attention_per_segment(monkeypatch, dtype, causal, window):
    """On CUDA, half and bfloat16 go through torch's flash varlen kernel (float32: the reference), forward, lse and
    the augmented backward; against the float64 dense reference on the CPU, bf16 tolerance for both half types."""
    calls = []
    for name in ("_flash_attention_forward", "_flash_attention_backward"):
        kernel = getattr(torch.ops.aten, name)
        monkeypatch.setattr(torch.ops.aten, name, lambda *a, kernel=kernel, name=name, **k: calls.append(name)
                            or kernel(*a, **k))
    q, k, v, cu_q, cu_k = inputs(dtype)
    qc, kc, vc = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    out, lse = run_op(qc, kc, vc, cu_q.cuda(), cu_k.cuda(), causal, window)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = dense(qd, kd, vd, cu_q, cu_k, causal, window, D ** -0.5)
    compare((out.cpu(), lse.cpu()), (ref_out, ref_lse), torch.bfloat16 if dtype != torch.float32 else dtype)
    got = [g.cpu() for g in gradients(out.cpu(), lse.cpu(), qc, kc, vc)]
    compare(got, gradients(ref_out, ref_lse, qd, kd, vd), torch.bfloat16 if dtype != torch.float32 else dtype)
    flash = dtype != torch.float32 and torch.cuda.get_device_capability() >= (8, 0)
    assert calls == (["_flash_attention_forward", "_flash_attention_backward"] if flash else []), calls
