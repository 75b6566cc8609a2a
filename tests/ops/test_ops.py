"""Native ops against their plain-PyTorch references, forward and backward, float64 and working dtypes,
random shapes including odd sizes; torch.library.opcheck on every op; the native CPU build must load.

Tolerances (max abs error relative to the reference, with the reference computed in float64 for float64 and
in fp32 accumulation otherwise): float64 1e-10; float32 1e-5 (rel); bfloat16 2e-2; float16 2e-3 — bf16/fp16
outputs are rounded once from fp32, so one ulp of the output dtype plus accumulation-order noise.
"""

import random

import pytest
import torch

import mm_adaptor.ops as ops
from mm_adaptor.ops.library import SPECS, ensure, op

TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2),
       torch.float16: (2e-3, 2e-3)}
DTYPES = list(TOL)
SHAPES = [(1, 7), (3, 5, 33), (17, 255), (64, 1024), (2, 3, 4, 130)]


@pytest.fixture(scope="module", autouse=True)
def native_cpu():
    state = ensure("cpu")
    assert state["native"], f"the native CPU ops did not build: {state['why']}"


def reference(name):
    return SPECS[name].reference


def poison_allocator():
    """Leave NaNs in freshly freed memory so an op that forgets to write part of its output is caught."""
    junk = [torch.full((1 << 16,), float("nan")) for _ in range(8)]
    del junk


def close(actual, expected, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), rtol=rtol, atol=atol)


def rand(shape, dtype, seed, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return t.requires_grad_(requires_grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(dtype, shape):
    seed = random.randrange(1 << 30)
    x, w, dy = rand(shape, dtype, seed), rand(shape[-1:], dtype, seed + 1), rand(shape, dtype, seed + 2)
    poison_allocator()
    y, rstd = op("rms_norm_fwd")(x, w, 1e-5)
    y_ref, rstd_ref = reference("rms_norm_fwd")(x, w, 1e-5)
    close(y, y_ref, dtype)
    close(rstd, rstd_ref, torch.float32 if dtype != torch.float64 else dtype)
    poison_allocator()
    dx, dw = op("rms_norm_bwd")(dy, x, w, rstd_ref)
    dx_ref, dw_ref = reference("rms_norm_bwd")(dy, x, w, rstd_ref)
    close(dx, dx_ref, dtype)
    close(dw, dw_ref, dtype if dtype == torch.float64 else torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 5, 34), (17, 254), (64, 2048), (5, 2202)])  # 2202: a partial last block
def test_swiglu(dtype, shape):
    seed = random.randrange(1 << 30)
    x = rand(shape, dtype, seed)
    dy = rand((*shape[:-1], shape[-1] // 2), dtype, seed + 1)
    poison_allocator()
    close(op("swiglu_fwd")(x), reference("swiglu_fwd")(x), dtype)
    poison_allocator()
    close(op("swiglu_bwd")(dy, x), reference("swiglu_bwd")(dy, x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("s,b,h,d,rot", [(1, 1, 1, 2, 2), (7, 3, 5, 16, 16), (9, 2, 3, 24, 10), (33, 2, 4, 64, 32)])
def test_rotary_pos_emb(dtype, interleaved, s, b, h, d, rot):
    seed = random.randrange(1 << 30)
    t, dy = rand((s, b, h, d), dtype, seed), rand((s, b, h, d), dtype, seed + 1)
    freqs = rand((s, 1, 1, rot), torch.float32, seed + 2) * 3
    poison_allocator()
    close(op("rotary_pos_emb_fwd")(t, freqs, interleaved), reference("rotary_pos_emb_fwd")(t, freqs, interleaved),
          dtype)
    poison_allocator()
    close(op("rotary_pos_emb_bwd")(dy, freqs, interleaved), reference("rotary_pos_emb_bwd")(dy, freqs, interleaved),
          dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_megatron_apply_rotary_pos_emb(dtype):
    """Megatron's angles repeat within each rotary pair (the kernel then computes one cos/sin per pair)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    for interleaved in (False, True):
        t = torch.randn(11, 2, 3, 32, dtype=torch.float64)
        base = torch.randn(11, 1, 1, 12, dtype=torch.float64)
        freqs = (torch.stack([base, base], -1).flatten(-2) if interleaved else torch.cat([base, base], -1))
        expected = _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
        angles = freqs if dtype == torch.float64 else freqs.float()
        close(ops.rotary_pos_emb(t.to(dtype), angles, interleaved), expected.to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,out,inp", [(1, 1, 1), (37, 5, 9), (4100, 17, 33), (128, 64, 128)])
def test_matmul_add_fp32(dtype, tokens, out, inp):
    seed = random.randrange(1 << 30)
    go, x = rand((tokens, out), dtype, seed), rand((tokens, inp), dtype, seed + 1)
    start = rand((out, inp), torch.float32, seed + 2)  # accumulation target: existing values must be kept
    main_grad, expected = start.clone(), start.clone()
    op("matmul_add_fp32")(main_grad, go, x)
    reference("matmul_add_fp32")(expected, go, x)
    # fp32 accumulation over `tokens` products: the error grows like sqrt(tokens)
    torch.testing.assert_close(main_grad, expected, rtol=1e-5, atol=4e-6 * tokens ** 0.5)
    assert main_grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [[3, 0, 5], [0, 0, 1], [16, 7, 1, 9], [0, 0, 0]])
def test_grouped_matmul(dtype, counts):
    seed = random.randrange(1 << 30)
    tokens, inp, out = sum(counts), 13, 6
    x, w = rand((tokens, inp), dtype, seed), rand((len(counts), inp, out), dtype, seed + 1)
    dy = rand((tokens, out), dtype, seed + 2)
    c = torch.tensor(counts)
    close(op("grouped_matmul_fwd")(x, w, c), reference("grouped_matmul_fwd")(x, w, c), dtype)
    dx, dw = op("grouped_matmul_bwd")(dy, x, w, c)
    dx_ref, dw_ref = reference("grouped_matmul_bwd")(dy, x, w, c)
    close(dx, dx_ref, dtype)
    close(dw, dw_ref, dtype)
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.count_nonzero(dw[e]) == 0, "an expert without tokens gets a zero gradient"


def test_grouped_matmul_rejects_wrong_counts():
    with pytest.raises(RuntimeError, match="sums to 4 but x has 5 rows"):
        ops.grouped_matmul(torch.randn(5, 3), torch.randn(2, 3, 4), torch.tensor([1, 3]))


def test_autograd_formulas_gradcheck():
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: ops.rms_norm(a, b, 1e-6), (x, w))
    x2 = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ops.swiglu, (x2,))
    t = torch.randn(5, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    freqs = torch.randn(5, 1, 1, 6, dtype=torch.float64)
    for inter in (False, True):
        assert torch.autograd.gradcheck(lambda a: ops.rotary_pos_emb(a, freqs, inter), (t,))
    xg = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    wg = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: ops.grouped_matmul(a, b, torch.tensor([2, 0, 4])), (xg, wg))


OPCHECK_CASES = [
    ("rms_norm_fwd", lambda: (torch.randn(3, 8, requires_grad=True), torch.randn(8, requires_grad=True), 1e-5)),
    ("rms_norm_bwd", lambda: (torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.rand(3) + 0.5)),
    ("swiglu_fwd", lambda: (torch.randn(3, 8, requires_grad=True),)),
    ("swiglu_bwd", lambda: (torch.randn(3, 4), torch.randn(3, 8))),
    ("rotary_pos_emb_fwd", lambda: (torch.randn(4, 2, 2, 8, requires_grad=True), torch.randn(4, 1, 1, 6), False)),
    ("rotary_pos_emb_bwd", lambda: (torch.randn(4, 2, 2, 8), torch.randn(4, 1, 1, 6), True)),
    ("matmul_add_fp32", lambda: (torch.randn(5, 6), torch.randn(7, 5, dtype=torch.bfloat16),
                                 torch.randn(7, 6, dtype=torch.bfloat16))),
    ("grouped_matmul_fwd", lambda: (torch.randn(6, 4, requires_grad=True), torch.randn(3, 4, 5, requires_grad=True),
                                    torch.tensor([2, 0, 4]))),
    ("grouped_matmul_bwd", lambda: (torch.randn(6, 5), torch.randn(6, 4), torch.randn(3, 4, 5),
                                    torch.tensor([2, 0, 4]))),
]


@pytest.mark.parametrize("name,make_args", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES])
def test_opcheck(name, make_args):
    torch.library.opcheck(op(name), make_args())


def test_opcheck_covers_every_op():
    assert sorted(name for name, _ in OPCHECK_CASES) == sorted(SPECS)


def _math_attention(q, k, v, causal, mask, scale):
    hq, hkv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    blocked = torch.zeros_like(scores, dtype=torch.bool)
    if causal:
        blocked |= torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1)
    if mask is not None:
        blocked |= mask
    probs = scores.masked_fill(blocked, float("-inf")).softmax(-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal,padded,hq,hkv", [(True, False, 4, 4), (True, False, 4, 2), (False, True, 4, 1),
                                                   (True, True, 6, 3)])
def test_flash_attention(dtype, causal, padded, hq, hkv):
    s, b, d = 13, 2, 16
    q = torch.randn(s, b, hq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(s, b, hkv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(s, b, hkv, d, dtype=dtype, requires_grad=True)
    mask = None
    if padded:
        mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
        mask[1, :, :, -4:] = True  # the second sequence's last 4 keys are padding
    out = ops.flash_attention(q, k, v, causal=causal, attention_mask=mask, scale=d ** -0.5)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = _math_attention(q64, k64, v64, causal, mask, d ** -0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    grad = torch.randn_like(expected)
    out.backward(grad.to(dtype))
    expected.backward(grad)
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=5 * tol, atol=5 * tol)


def test_reference_fallback_without_a_compiler(tmp_path):
    import subprocess
    import sys

    code = ("import warnings, torch, mm_adaptor.ops as o\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    y = o.swiglu(torch.randn(2, 4))\n"
            "print(o.status()['devices']['cpu'])\n"
            "print([str(x.message) for x in w])\n")
    env = {"PATH": "/usr/bin:/bin", "CXX": "no-such-compiler-xyz", "MM_ADAPTOR_OPS_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("reference fallback: no C++ compiler ('no-such-compiler-xyz'")
    assert "references run instead" in result.stdout
