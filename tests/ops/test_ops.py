"""Native ops against their plain-PyTorch references, forward and backward, float64 and working dtypes,
random shapes including odd sizes; torch.library.opcheck on every op; the native CPU build must load.
Every op test also runs on CUDA where a GPU is present (the CUDA library must then build and load); the
shapes cover the CUDA kernels' 16-byte-pack paths, their scalar paths and their ATen fallbacks.

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
# (5, 16384): the widest rows held in registers; (2, 40000): wider than registers hold, the ATen path on CUDA
SHAPES = [(1, 7), (3, 5, 33), (17, 255), (64, 1024), (2, 3, 4, 130), (5, 16384), (2, 40000)]
NO_GPU = "no CUDA device here: the CUDA kernels are compile-checked only (tests/ops/test_builder.py)"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU))]


@pytest.fixture(scope="module", autouse=True)
def native_cpu():
    state = ensure("cpu")
    assert state["native"], f"the native CPU ops did not build: {state['why']}"


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cuda":
        state = ensure("cuda")
        assert state["native"], f"the native CUDA ops did not build: {state['why']}"
    return request.param


def on(device, *tensors):
    return [t.to(device) for t in tensors]


def reference(name):
    return SPECS[name].reference


def poison_allocator(device="cpu"):
    """Leave NaNs in freshly freed memory so an op that forgets to write part of its output is caught."""
    junk = [torch.full((1 << 16,), float("nan"), device=device) for _ in range(8)]
    del junk


def close(actual, expected, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual.cpu().to(torch.float64), expected.cpu().to(torch.float64), rtol=rtol, atol=atol)


def rand(shape, dtype, seed, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return t.requires_grad_(requires_grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(dtype, shape, device, weight_dtype=None):
    seed = random.randrange(1 << 30)
    x, dy = rand(shape, dtype, seed), rand(shape, dtype, seed + 2)
    w = rand(shape[-1:], weight_dtype or dtype, seed + 1)
    poison_allocator(device)
    y, rstd = op("rms_norm_fwd")(*on(device, x, w), 1e-5)
    y_ref, rstd_ref = reference("rms_norm_fwd")(x, w, 1e-5)
    close(y, y_ref, dtype)
    close(rstd, rstd_ref, torch.float32 if dtype != torch.float64 else dtype)
    assert rstd.dtype == rstd_ref.dtype
    poison_allocator(device)
    dx, dw = op("rms_norm_bwd")(*on(device, dy, x, w, rstd_ref))
    dx_ref, dw_ref = reference("rms_norm_bwd")(dy, x, w, rstd_ref)
    close(dx, dx_ref, dtype)
    close(dw, dw_ref, dtype if dtype == torch.float64 else torch.bfloat16)
    assert (dx.dtype, dw.dtype) == (dx_ref.dtype, dw_ref.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 64), (3, 4096), (2, 129)])
def test_rms_norm_with_fp32_weight(dtype, shape, device):
    test_rms_norm(dtype, shape, device, weight_dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
# 2202: a partial last block; 22016: 2 x 11008, a row of 16-byte packs
@pytest.mark.parametrize("shape", [(1, 2), (3, 5, 34), (17, 254), (64, 2048), (5, 2202), (3, 22016)])
def test_swiglu(dtype, shape, device):
    seed = random.randrange(1 << 30)
    x = rand(shape, dtype, seed)
    dy = rand((*shape[:-1], shape[-1] // 2), dtype, seed + 1)
    poison_allocator(device)
    close(op("swiglu_fwd")(*on(device, x)), reference("swiglu_fwd")(x), dtype)
    poison_allocator(device)
    close(op("swiglu_bwd")(*on(device, dy, x)), reference("swiglu_bwd")(dy, x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
# (5, 1, 2, 9, 8): an odd head dim; (6, 2, 4, 128, 64): packs with channels passed through; positions 1: broadcast
@pytest.mark.parametrize("s,b,h,d,rot,positions", [
    (1, 1, 1, 2, 2, 1), (7, 3, 5, 16, 16, 7), (9, 2, 3, 24, 10, 9), (33, 2, 4, 64, 32, 33), (5, 1, 2, 9, 8, 5),
    (6, 2, 4, 128, 128, 6), (6, 2, 4, 128, 64, 6), (4, 2, 3, 32, 32, 1)])
def test_rotary_pos_emb(dtype, interleaved, s, b, h, d, rot, positions, device):
    seed = random.randrange(1 << 30)
    t, dy = rand((s, b, h, d), dtype, seed), rand((s, b, h, d), dtype, seed + 1)
    freqs = rand((positions, 1, 1, rot), torch.float32, seed + 2) * 3
    poison_allocator(device)
    close(op("rotary_pos_emb_fwd")(*on(device, t, freqs), interleaved),
          reference("rotary_pos_emb_fwd")(t, freqs, interleaved), dtype)
    poison_allocator(device)
    close(op("rotary_pos_emb_bwd")(*on(device, dy, freqs), interleaved),
          reference("rotary_pos_emb_bwd")(dy, freqs, interleaved), dtype)


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
def test_matmul_add_fp32(dtype, tokens, out, inp, device):
    seed = random.randrange(1 << 30)
    go, x = rand((tokens, out), dtype, seed), rand((tokens, inp), dtype, seed + 1)
    start = rand((out, inp), torch.float32, seed + 2)  # accumulation target: existing values must be kept
    main_grad, expected = start.clone().to(device), start.clone()
    op("matmul_add_fp32")(main_grad, *on(device, go, x))
    reference("matmul_add_fp32")(expected, go, x)
    # fp32 accumulation over `tokens` products: the error grows like sqrt(tokens)
    torch.testing.assert_close(main_grad.cpu(), expected, rtol=1e-5, atol=4e-6 * tokens ** 0.5)
    assert main_grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [[3, 0, 5], [0, 0, 1], [16, 7, 1, 9], [0, 0, 0]])
def test_grouped_matmul(dtype, counts, device):
    seed = random.randrange(1 << 30)
    tokens, inp, out = sum(counts), 13, 6
    x, w = rand((tokens, inp), dtype, seed), rand((len(counts), inp, out), dtype, seed + 1)
    dy = rand((tokens, out), dtype, seed + 2)
    c = torch.tensor(counts)
    close(op("grouped_matmul_fwd")(*on(device, x, w), c), reference("grouped_matmul_fwd")(x, w, c), dtype)
    dx, dw = op("grouped_matmul_bwd")(*on(device, dy, x, w), c)
    dx_ref, dw_ref = reference("grouped_matmul_bwd")(dy, x, w, c)
    close(dx, dx_ref, dtype)
    close(dw, dw_ref, dtype)
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.count_nonzero(dw[e]) == 0, "an expert without tokens gets a zero gradient"


def test_grouped_matmul_rejects_wrong_counts_before_the_native_call(monkeypatch):
    """Host counts are checked in Python: the native kernel (its own TORCH_CHECK: test_builder.py) is never called."""
    import importlib

    module = importlib.import_module("mm_adaptor.ops.grouped_matmul")  # the package's name is the function
    monkeypatch.setattr(module, "op", lambda name: pytest.fail(f"{name} was called with wrong counts"))
    for counts, message in (([1, 3], "sums to 4 but x has 5 rows"), ([6, -1], "negative token count -1"),
                            ([5], "has 1 entries for 2 experts")):
        with pytest.raises(RuntimeError, match=message):
            ops.grouped_matmul(torch.randn(5, 3), torch.randn(2, 3, 4), torch.tensor(counts))


def test_autograd_formulas_gradcheck():
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: ops.rms_norm(a, b, 1e-6), (x, w))
    x2 = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ops.swiglu, (x2,))
    t = torch.randn(5, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    freqs = torch.randn(5, 1, 1, 6, dtype=torch.float64)
    for inter in (False, True):
        assert torch.autograd.gradcheck(lambda a, inter=inter: ops.rotary_pos_emb(a, freqs, inter), (t,))
    xg = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    wg = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: ops.grouped_matmul(a, b, torch.tensor([2, 0, 4])), (xg, wg))


def _words_with_exceptions():
    """fp32 words and bf16 high halves, two of which differ by more than an int16 (a tie rounded to even)."""
    main = torch.randn(40)
    main.view(torch.int32)[[3, 17]] = torch.tensor([0x3F808000, 0x40008000], dtype=torch.int32)
    return main, main.to(torch.bfloat16)


def _multi_split_args(round_model, sizes=(40, 9)):
    """round_split_fp32_words's arguments for tensors of `sizes` words (the first with two exceptions)."""
    mains = [_words_with_exceptions()[0]] + [torch.randn(n) for n in sizes[1:]]
    return ([m for m in mains], [m.to(torch.bfloat16) for m in mains], [torch.empty(m.numel(), dtype=torch.int16)
                                                                        for m in mains],
            [torch.empty(4, dtype=torch.int64) for _ in mains], [torch.empty(4, dtype=torch.int32) for _ in mains],
            torch.zeros(len(mains), dtype=torch.int64), round_model)


def _multi_join_args():
    mains, models, residuals, indices, kept, counts, _ = _multi_split_args(True)
    op("round_split_fp32_words")(mains, models, residuals, indices, kept, counts, True)
    return models, residuals, indices, kept, [counts[t:t + 1] for t in range(len(mains))], \
        [torch.empty_like(m) for m in mains]


# cu_seqlens_q, cu_seqlens_k (3 segments, one query of fewer than its keys), max lengths, causal, scale, window
_VARLEN_ARGS = (torch.tensor([0, 3, 4, 8], dtype=torch.int32), torch.tensor([0, 2, 5, 9], dtype=torch.int32), 4, 4,
                True, 0.5, 2, -1)
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
    ("host_mapped_copy", lambda: (torch.randn(3, 5),)),
    ("split_fp32_words", lambda: (*_words_with_exceptions(), 4)),
    ("join_fp32_words", lambda: (lambda main, model: (model, *ops.split_fp32_words(main, model),
                                                      torch.empty_like(main)))(*_words_with_exceptions())),
    ("round_split_fp32_words", lambda: _multi_split_args(True)),
    ("join_fp32_words_multi", lambda: _multi_join_args()),
    ("varlen_attention_fwd", lambda: (torch.randn(8, 4, 8, requires_grad=True),
                                      torch.randn(9, 2, 8, requires_grad=True),
                                      torch.randn(9, 2, 8, requires_grad=True), *_VARLEN_ARGS)),
    ("varlen_attention_bwd", lambda: (torch.randn(8, 4, 8), torch.randn(4, 8), torch.randn(8, 4, 8),
                                      torch.randn(9, 2, 8), torch.randn(9, 2, 8), torch.randn(8, 4, 8),
                                      torch.randn(4, 8), *_VARLEN_ARGS)),
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


@pytest.mark.parametrize("numel", [0, 1, 33, 4097, 300_001])
def test_fp32_words_split_and_join(numel, device):
    """Bit for bit equal to the reference (residuals, exception positions) and a lossless round trip, with ties
    rounded to even and high halves that are not the words' rounding."""
    gen = torch.Generator().manual_seed(numel)
    words = torch.randint(-2**31, 2**31, (numel,), dtype=torch.int64, generator=gen)
    words[::7] = (words[::7] >> 16 << 16) + 0x8000  # ties
    main = words.to(torch.int32).view(torch.float32)
    model = main.to(torch.bfloat16)
    model[::11] = torch.randn(model[::11].shape, generator=gen).to(torch.bfloat16)
    main_d, model_d = on(device, main, model)
    residual, index, kept = ops.split_fp32_words(main_d, model_d)
    ref_residual, ref_index, _, ref_count = reference("split_fp32_words")(main, model, numel)
    ref_index = ref_index[:int(ref_count)]
    assert torch.equal(residual.cpu(), ref_residual) and torch.equal(index.cpu(), ref_index)
    poison_allocator(device)
    out = torch.empty_like(main_d)
    ops.join_fp32_words(out, model_d, residual, index, kept)
    assert torch.equal(out.cpu().view(torch.int32), main.view(torch.int32))


@pytest.mark.parametrize("capacity", [0, 1, 3, 50])
def test_fp32_words_split_lists_at_most_capacity_and_counts_all(capacity, device):
    """The split never sizes an output from the data (no read back to the host): exceptions fill a buffer of
    `capacity` entries and a device counter holds how many there are; the wrapper splits again on overflow."""
    words = torch.randn(9000, generator=torch.Generator().manual_seed(3)).view(torch.int32)
    words[::300] = (words[::300] >> 17 << 17) + 0x8000  # ties with an even high half: rounded down, kept whole
    main = words.view(torch.float32)
    model = main.to(torch.bfloat16)
    main_d, model_d = on(device, main, model)
    residual, index, kept, count = op("split_fp32_words")(main_d, model_d, capacity)
    expected = reference("split_fp32_words")(main, model, 9000)[1]
    expected = expected[expected >= 0]
    assert expected.numel() == 30 and index.shape == kept.shape == (capacity,) and count.device == main_d.device
    assert int(count) == 30
    listed = min(capacity, 30)
    got = index.cpu()[:listed].sort().values
    if capacity >= 30:
        assert torch.equal(got, expected) and torch.equal(index.cpu()[30:], torch.full((capacity - 30,), -1))
    else:  # which ones fill the buffer is the kernel's choice; each listed one is a true exception
        assert set(got.tolist()) <= set(expected.tolist())
    assert torch.equal(kept.cpu()[:listed], main.view(torch.int32)[index.cpu()[:listed]])
    full_residual, full_index, full_kept = ops.split_fp32_words(main_d, model_d)
    assert torch.equal(full_index.cpu(), expected) and torch.equal(full_residual.cpu(), residual.cpu())


@pytest.mark.parametrize("round_model", [True, False], ids=["rounding", "given-model"])
def test_fp32_words_multi_tensor_split_and_join(round_model, device):
    """One call per batch: each tensor split as split_fp32_words would (round_model: against the model values
    torch's fp32 -> bf16 copy writes on this device, which the op writes), restored bit for bit. Sizes cover the
    16-byte paths, their tails, one-word tensors and a tensor that is not 16-byte aligned."""
    gen = torch.Generator().manual_seed(7)
    sizes = [1, 7, 8, 4097, 70_001, 33]
    words = [torch.randint(-2**31, 2**31, (n,), dtype=torch.int64, generator=gen) for n in sizes]
    for w in words:
        w[::5] = (w[::5] >> 16 << 16) + 0x8000  # ties
    mains = [w.to(torch.int32).view(torch.float32).to(device) for w in words]
    mains[-1] = torch.cat([torch.zeros(1, device=device), mains[-1]])[1:]  # 4 bytes off 16-byte alignment
    expected_models = [m.to(torch.bfloat16) for m in mains]  # megatron's copy on this device
    models = [torch.randn(m.numel(), generator=gen).to(torch.bfloat16).to(device) for m in mains]
    given = [m.clone() for m in models]
    residuals = [torch.empty(m.numel(), dtype=torch.int16, device=device) for m in mains]
    indices = [torch.empty(m.numel() + 1, dtype=torch.int64, device=device) for m in mains]  # room for all
    kept = [torch.empty(i.numel(), dtype=torch.int32, device=device) for i in indices]
    counts = torch.zeros(len(mains), dtype=torch.int64, device=device)
    op("round_split_fp32_words")(mains, models, residuals, indices, kept, counts, round_model)
    for t, main in enumerate(mains):
        against = expected_models[t] if round_model else given[t]
        assert torch.equal(models[t].view(torch.int16), against.view(torch.int16)), t
        ref_residual, ref_index, _, ref_count = reference("split_fp32_words")(main.cpu(), against.cpu(), main.numel())
        assert int(counts[t]) == int(ref_count) <= indices[t].numel(), t
        assert torch.equal(residuals[t].cpu(), ref_residual), t
        listed = indices[t][:int(ref_count)].cpu().sort().values
        assert torch.equal(listed, ref_index[:int(ref_count)]), t
    poison_allocator(device)
    outs = [torch.empty_like(m) for m in mains]
    op("join_fp32_words_multi")(models, residuals, indices, kept, [counts[t:t + 1] for t in range(len(mains))], outs)
    for out, main in zip(outs, mains):
        assert torch.equal(out.view(torch.int32), main.view(torch.int32))
