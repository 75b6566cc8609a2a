"""flash_attention with attention dropout (the blockwise CPU path) and Megatron's masking semantics, against a plain
PyTorch reference that uses the same dropout mask: float64 and float32, odd sizes, GQA, causal and padding masks."""

import pytest
import torch

import mm_adaptor.ops as ops
from mm_adaptor.ops import attention

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def reference(q, k, v, causal, mask, scale, keep=None):
    """Megatron's DotProductAttention written out: masked scores -10000, softmax, dropout (keep is pre-scaled)."""
    hq, hkv = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(hq // hkv, dim=2), v.repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    sq, sk = q.shape[0], k.shape[0]
    blocked = torch.zeros_like(scores, dtype=torch.bool)
    if causal:
        blocked |= ~torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    if mask is not None:
        blocked |= mask
    probs = scores.masked_fill(blocked, -10000.0).softmax(-1)
    if keep is not None:
        probs = probs * keep.to(probs.dtype)
    return torch.einsum("bhst,tbhd->sbhd", probs, v)


def inputs(sq, sk, b, hq, hkv, d, dv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
            for shape in ((sq, b, hq, d), (sk, b, hkv, d), (sk, b, hkv, dv))]


def padding_mask(b, sq, sk):
    mask = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
    mask[-1, :, :, -3:] = True  # the last sequence's last 3 keys are padding
    mask[0, :, 1, :] = True  # a fully masked query row
    return mask


def keep_mask(seed_state, shape, p):
    """The masks the op drew: the same seed from the same generator state, the same blocks."""
    torch.manual_seed(seed_state)
    seed = attention.draw_seed(torch.device("cpu"))
    b, h, sq, sk = shape
    rows = attention.block_rows(b, h, sk)
    return torch.cat(list(attention.dropout_keep_blocks(seed, shape, p, rows, torch.device("cpu"))), dim=2)


CASES = {  # sq, sk, b, hq, hkv, d, dv, causal, padded
    "causal-odd": (13, 13, 2, 3, 3, 7, 7, True, False),
    "gqa-padded": (9, 11, 3, 4, 2, 5, 5, False, True),
    "gqa-causal-padded": (17, 17, 2, 6, 3, 8, 8, True, True),
    "mqa-value-dim": (5, 7, 1, 4, 1, 6, 3, True, False),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_blockwise_attention_against_reference(monkeypatch, dtype, case, p):
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", 100)  # several blocks of query rows, the last one shorter
    sq, sk, b, hq, hkv, d, dv, causal, padded = case
    q, k, v = inputs(sq, sk, b, hq, hkv, d, dv, dtype, seed=sq * 100 + sk)
    mask = padding_mask(b, sq, sk) if padded else None
    scale = 0.7 / d ** 0.5
    torch.manual_seed(11)
    if p == 0 and d == dv:  # the fused kernels serve this in flash_attention
        out = attention.BlockwiseAttention.apply(q, k, v, mask, causal, scale, 0.0)
    else:
        out = ops.flash_attention(q, k, v, causal=causal, attention_mask=mask, scale=scale, dropout_p=p)
    keep = keep_mask(11, (b, hq, sq, sk), p) if p else None
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    expected = reference(q2, k2, v2, causal, mask, scale, keep)
    tol = TOL[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    for name, got, want in (("dq", q.grad, q2.grad), ("dk", k.grad, k2.grad), ("dv", v.grad, v2.grad)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)


def test_bf16_inputs_run_in_fp32():
    q, k, v = inputs(9, 9, 2, 4, 2, 8, 8, torch.bfloat16, seed=3)
    torch.manual_seed(0)
    out = ops.flash_attention(q, k, v, causal=True, dropout_p=0.2)
    assert out.dtype == torch.bfloat16
    keep = keep_mask(0, (2, 4, 9, 9), 0.2)
    expected = reference(*(t.detach().double() for t in (q, k, v)), True, None, 8 ** -0.5, keep)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 and t.grad.isfinite().all() for t in (q, k, v))


def test_same_seed_same_output_and_gradients():
    q, k, v = inputs(12, 12, 2, 2, 2, 8, 8, torch.float32, seed=5)
    results = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        out = ops.flash_attention(q, k, v, causal=True, dropout_p=0.25)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        results.append((out.detach(), grads))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    assert not torch.equal(results[0][0], results[2][0]), "another seed draws another mask"


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropped_fraction_is_p(p):
    """Zero queries give uniform probabilities 1/sk; one-hot values expose each kept probability."""
    sq = sk = 64
    b, h = 2, 4
    q = torch.zeros(sq, b, h, 8)
    k = torch.randn(sk, b, h, 8)
    v = torch.eye(sk).reshape(sk, 1, 1, sk).expand(sk, b, h, sk).contiguous()
    torch.manual_seed(0)
    probs = ops.flash_attention(q, k, v, causal=False, dropout_p=p)
    dropped = (probs == 0).double().mean().item()
    assert abs(dropped - p) < 0.02, dropped
    kept = probs[probs != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / ((1 - p) * sk)))


def test_no_score_matrix_is_saved_for_backward():
    sq = sk = 64
    b, h = 2, 4
    q, k, v = inputs(sq, sk, b, h, h, 8, 8, torch.float32, seed=1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ops.flash_attention(q, k, v, causal=True, attention_mask=padding_mask(b, sq, sk), dropout_p=0.1)
    # q, k, v, the output, two fp32 row statistics and the (input) mask: less than one fp32 score matrix
    assert sorted(t.numel() for t in saved) == sorted([b * h * sq] * 2 + [b * sq * sk] + [b * h * sq * 8] * 4)
    assert sum(t.numel() * t.element_size() for t in saved) < b * h * sq * sk * 4


def test_dropout_zero_keeps_the_fused_kernels(monkeypatch):
    monkeypatch.setattr(attention.BlockwiseAttention, "apply", None)
    q, k, v = inputs(8, 8, 1, 2, 2, 8, 8, torch.float32, seed=2)
    ops.flash_attention(q, k, v, causal=True, dropout_p=0.0).sum().backward()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_path_gives_fully_masked_rows_megatrons_uniform_average(dtype, causal):
    q, k, v = inputs(9, 9, 3, 4, 2, 8, 8, dtype, seed=4)
    mask = padding_mask(3, 9, 9)
    out = ops.flash_attention(q, k, v, causal=causal, attention_mask=mask, scale=0.4)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    expected = reference(q2, k2, v2, causal, mask, 0.4)
    torch.testing.assert_close(out[1, 0], v.detach().mean(0)[0].repeat_interleave(2, 0).to(dtype))
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_rejects_a_dropout_probability_outside_0_1():
    q = torch.randn(4, 1, 2, 8)
    with pytest.raises(ValueError, match="dropout_p"):
        ops.flash_attention(q, q, q, dropout_p=1.5)
