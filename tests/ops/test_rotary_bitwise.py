"""The CUDA rotary kernel bit for bit against a reference that computes the same thing: cos/sin of the fp32 angles
in float64 rounded to fp32 (the kernel's double sincos), the same rotate formula per element in fp32, rounded once
to the output dtype. nvcc contracts one product of each output into an FMA, and which one varies with the pack
width, so each element must equal one of the three exact fp32 results: either product fused, or neither. The
reference's exact rounding is checked against rational arithmetic here; the kernel runs where a GPU is present.

Shapes: b*h of 1 and 3 with s = 4099 (prime: positions grouped per block, never dividing s), b*h over one block's
rows (grid y), rot < d (channels passed through), broadcast freqs, a rotary dim wider than one shared table
(chunks), packs of 1 and 2 channels; fp32, bf16, fp16; rotate-half and interleaved; forward and backward."""

import random
from fractions import Fraction

import pytest
import torch

from mm_adaptor.ops.library import ensure, op

NO_GPU = "no CUDA device here: the CUDA kernels are compile-checked only (tests/ops/test_builder.py)"
INF = float("inf")


def round_sum(a, b):
    """The fp32 nearest to the exact a + b (float64 tensors), ties to even: float64's sum and its exact error
    (TwoSum); the sum rounds to fp32 directly unless it lies on an fp32 midpoint, where the error's sign decides."""
    s = a + b
    bb = s - a
    err = (a - (s - bb)) + (b - bb)
    r = s.float()
    rd = r.double()
    other = torch.nextafter(r, torch.where(s > rd, INF, -INF).float())
    midpoint = (s != rd) & (s == (rd + other.double()) / 2)
    up, down = torch.maximum(r, other), torch.minimum(r, other)
    return torch.where(midpoint & (err != 0), torch.where(err > 0, up, down), r)


def mul(a, b):
    return (a.double() * b.double()).float()  # fp32 x fp32 is exact in float64: one rounding


def fma(a, b, c):
    return round_sum(a.double() * b.double(), c.double())


def dot2(p, q, r, s):
    """p*q + r*s in fp32, stacked: p*q fused into an FMA, r*s fused, neither."""
    return torch.stack([fma(p, q, mul(r, s)), fma(r, s, mul(p, q)), round_sum(mul(p, q).double(),
                                                                              mul(r, s).double())])


def pairs(t, rot, interleaved):
    return (t[..., 0:rot:2], t[..., 1:rot:2]) if interleaved else (t[..., : rot // 2], t[..., rot // 2: rot])


def candidates(t, freqs, interleaved, backward, cos_sin_device):
    """[3, *t.shape] in t's dtype: the kernel's output must equal one of them in every element."""
    rot = freqs.shape[-1]
    angles = freqs.to(cos_sin_device, torch.float64)
    cos, sin = angles.cos().float().cpu(), angles.sin().float().cpu()
    x0, x1 = pairs(t.float(), rot, interleaved)
    c0, c1 = pairs(cos, rot, interleaved)
    s0, s1 = pairs(sin, rot, interleaved)
    if backward:  # y0 = x0 c0 + x1 s1, y1 = x1 c1 - x0 s0
        y0, y1 = dot2(x0, c0.expand_as(x0), x1, s1.expand_as(x0)), dot2(x1, c1.expand_as(x0), -x0, s0.expand_as(x0))
    else:  # y0 = x0 c0 - x1 s0, y1 = x1 c1 + x0 s1
        y0, y1 = dot2(x0, c0.expand_as(x0), -x1, s0.expand_as(x0)), dot2(x1, c1.expand_as(x0), x0, s1.expand_as(x0))
    out = t.float().expand(3, *t.shape).clone()
    first, second = pairs(out, rot, interleaved)
    first.copy_(y0)
    second.copy_(y1)
    return out.to(t.dtype)


def exact_fp32(value: Fraction) -> float:
    """Round a rational to fp32, ties to even (through the two neighbouring floats)."""
    low = torch.tensor(float(value), dtype=torch.float64).float()  # within a float64 rounding: a neighbour
    for _ in range(2):
        if Fraction(low.item()) > value:
            low = torch.nextafter(low, torch.tensor(-INF))
    high = torch.nextafter(low, torch.tensor(INF))
    while Fraction(high.item()) < value:
        low, high = high, torch.nextafter(high, torch.tensor(INF))
    below, above = value - Fraction(low.item()), Fraction(high.item()) - value
    if below != above:
        return (low if below < above else high).item()
    return (low if low.view(torch.int32).item() % 2 == 0 else high).item()


def test_the_reference_rounds_exactly():
    """fma, mul and round_sum give the correctly rounded fp32 of the exact result, midpoints included."""
    gen = torch.Generator().manual_seed(5)
    a, b, c, d = (torch.randn(400, generator=gen) * torch.exp2(torch.randint(-30, 30, (400,), generator=gen))
                  for _ in range(4))
    # midpoints: c one half-ulp from -a*b's fp32 neighbour
    ab = mul(a[:100], b[:100])
    c[:100] = -(ab.double() + (torch.nextafter(ab, torch.tensor(INF)).double() - ab.double()) / 2).float()
    got_fma, got_mul, got_sum = fma(a, b, c), mul(a, b), round_sum(c.double(), d.double())
    for i in range(400):
        fa, fb, fc, fd = (Fraction(v[i].item()) for v in (a, b, c, d))
        assert got_fma[i].item() == exact_fp32(fa * fb + fc), i
        assert got_mul[i].item() == exact_fp32(fa * fb), i
        assert got_sum[i].item() == exact_fp32(fc + fd), i
    plain = a * b + c * d  # torch's fp32 ops round each step: the 'neither fused' candidate
    assert torch.equal(dot2(a, b, c, d)[2], plain)


# (s, b, h, d, rot, positions)
SHAPES = [(4099, 1, 1, 128, 128, 4099), (4099, 1, 3, 128, 64, 4099), (5, 4, 80, 128, 64, 5), (4099, 1, 2, 64, 64, 1),
          (6, 4, 40, 64, 32, 1), (3, 1, 2, 4352, 4224, 3), (9, 2, 3, 24, 10, 9)]


def rotary_inputs(shape, dtype, seed, megatron_pairs):
    s, b, h, d, rot, positions = shape
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(s, b, h, d, generator=gen).to(dtype)
    dy = torch.randn(s, b, h, d, generator=gen).to(dtype)
    if megatron_pairs:  # positions x inverse frequencies, each angle twice (the kernel then computes it once)
        base = torch.arange(positions, dtype=torch.float32)[:, None] * torch.rand(rot // 2, generator=gen)
        freqs = torch.cat([base, base], -1) if random.Random(seed).random() < 0.5 else base.repeat_interleave(2, -1)
    else:
        freqs = torch.randn(positions, rot, generator=gen) * 3
    return t, dy, freqs.view(positions, 1, 1, rot)


def assert_one_of(out, expected, label):
    hits = (out.cpu().unsqueeze(0) == expected).any(0)
    if not bool(hits.all()):
        where = (~hits).nonzero()[0].tolist()
        raise AssertionError(f"{label}: {int((~hits).sum())} of {hits.numel()} elements differ, first at {where}: "
                             f"{out.cpu()[tuple(where)].item()} not in {expected[(slice(None), *where)].tolist()}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "x".join(map(str, shape)))
def test_cuda_rotary_is_bitwise_the_formula(dtype, interleaved, shape):
    state = ensure("cuda")
    assert state["native"], f"the native CUDA ops did not build: {state['why']}"
    for megatron_pairs in (False, True):
        t, dy, freqs = rotary_inputs(shape, dtype, seed=sum(shape) + megatron_pairs, megatron_pairs=megatron_pairs)
        for name, x, backward in (("rotary_pos_emb_fwd", t, False), ("rotary_pos_emb_bwd", dy, True)):
            out = op(name)(x.cuda(), freqs.cuda(), interleaved)
            assert_one_of(out, candidates(x, freqs, interleaved, backward, "cuda"),
                          f"{name} {dtype} interleaved={interleaved} megatron_pairs={megatron_pairs}")
