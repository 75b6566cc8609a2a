"""Context-parallel causal attention (patches/transformer/context_parallel.py) on gloo ranks equals whole-sequence
attention: Ulysses and the ring over 2 ranks, the ring over 4 and hybrid (Ulysses 2 x ring 2) over 4, with GQA,
forward and the gradients of q, k and v, in fp32 (tolerance 1e-5 relative; measured 2.0e-7 .. 2.4e-7) and bf16
inputs (1e-2; measured 4.1e-3: the blocks compute in fp32, so bf16 differs from the fp64 reference by the rounding
of the inputs, the output and the gradients).
The same for a pack (context_parallel_packed.py: every segment split over the ranks, attention within segments),
against causal attention within each segment of the whole pack, with a segment of one chunk per rank.
Broken variants must be rejected: a ring that forgets the causal mask of its diagonal blocks, Ulysses that gathers
the heads in the wrong order, and packed attention (ring or Ulysses) that crosses the segments."""

import pytest
import torch

from gloo_rank import a_rank, run_ranks

from mm_adaptor.core.sequence_split import local_half, local_segments

pytestmark = pytest.mark.distributed

SEQ, BATCH, HEADS, KV_HEADS, DIM = 32, 2, 4, 2, 8
SEGMENTS = [16, 8, 24, 8, 8]  # a pack: multiples of 2 x 4, at CP 4 the 8s are one token per chunk
FP32_TOLERANCE, BF16_TOLERANCE = 1e-5, 1e-2
# name: (ranks, Ulysses degree, dtype, broken, packed)
CASES = {
    "ulysses_2": (2, 2, "float32", None, False),
    "ring_2": (2, 1, "float32", None, False),
    "ring_2_bf16": (2, 1, "bfloat16", None, False),
    "ulysses_2_bf16": (2, 2, "bfloat16", None, False),
    "ring_2_no_diagonal_mask": (2, 1, "float32", "ring_diagonal", False),
    "ulysses_2_heads_misordered": (2, 2, "float32", "head_order", False),
    "ring_4": (4, 1, "float32", None, False),
    "hybrid_4": (4, 2, "float32", None, False),
    "packed_ulysses_2": (2, 2, "float32", None, True),
    "packed_ring_2": (2, 1, "float32", None, True),
    "packed_ring_2_bf16": (2, 1, "bfloat16", None, True),
    "packed_ring_4": (4, 1, "float32", None, True),
    "packed_hybrid_4": (4, 2, "float32", None, True),
    "packed_ring_2_across_segments": (2, 1, "float32", "across", True),
    "packed_ulysses_2_across_segments": (2, 2, "float32", "across", True),
}


def _split(x, rank, world, packed):
    return local_segments(x, rank, world, SEGMENTS) if packed else local_half(x, rank, world)


def _attention(q, k, v, segments=None):
    """Causal attention in fp64 of [s, b, heads, d], within each segment of a pack [T, 1, heads, d]."""
    groups = HEADS // KV_HEADS
    parts = zip(*(x.split(segments) for x in (q, k, v))) if segments else [(q, k, v)]
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        qs.permute(1, 2, 0, 3), ks.repeat_interleave(groups, 2).permute(1, 2, 0, 3),
        vs.repeat_interleave(groups, 2).permute(1, 2, 0, 3), is_causal=True).permute(2, 0, 1, 3)
        for qs, ks, vs in parts])


def _rank_main(workdir):
    import torch.distributed as dist

    from mm_adaptor.patches.transformer import context_parallel as cp

    with a_rank(workdir) as (case, results):
        world, rank = dist.get_world_size(), dist.get_rank()
        for name, (ranks, ulysses, dtype, broken, packed) in CASES.items():
            if ranks != world:
                continue
            rings = world // ulysses
            ulysses_groups = [dist.new_group(list(range(g * ulysses, (g + 1) * ulysses))) for g in range(rings)]
            ring_groups = [dist.new_group(list(range(j, world, ulysses))) for j in range(ulysses)]
            tensors = case["packed" if packed else "whole"]
            q, k, v, weight = (_split(tensors[x], rank, world, packed).to(getattr(torch, dtype)).requires_grad_()
                               for x in ("q", "k", "v", "weight"))
            extra = {"packed": (SEGMENTS, world), "cross_segments": broken == "across"} if packed else {}
            head_order = list(reversed(range(ulysses))) if broken == "head_order" else None
            out = cp.context_parallel_attention(q, k, v, ulysses_groups[rank // ulysses], ring_groups[rank % ulysses],
                                                diagonal_causal=broken != "ring_diagonal", head_order=head_order,
                                                **extra)
            (out.float() * weight.float()).sum().backward()
            results[name] = {"out": out.detach().float(), "dq": q.grad.float(), "dk": k.grad.float(),
                             "dv": v.grad.float()}


def _inputs(generator, length, batch):
    return {"q": torch.randn(length, batch, HEADS, DIM, generator=generator),
            "k": torch.randn(length, batch, KV_HEADS, DIM, generator=generator),
            "v": torch.randn(length, batch, KV_HEADS, DIM, generator=generator),
            "weight": torch.randn(length, batch, HEADS, DIM, generator=generator)}


def _expected(tensors, segments=None):
    """The fp64 reference: out and the gradients of sum(out * weight)."""
    q, k, v = (tensors[x].detach().double().requires_grad_() for x in ("q", "k", "v"))
    out = _attention(q, k, v, segments)
    (out * tensors["weight"].double()).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    generator = torch.Generator().manual_seed(0)
    case = {"whole": _inputs(generator, SEQ, BATCH), "packed": _inputs(generator, sum(SEGMENTS), 1)}
    expected = {"whole": _expected(case["whole"]), "packed": _expected(case["packed"], SEGMENTS)}
    ranks = {n: run_ranks(_rank_main, tmp_path_factory.mktemp(f"cp{n}"), case, nproc=n) for n in (2, 4)}
    return ranks, expected


def _worst_error(runs, name) -> float:
    ranks, expected = runs
    world, packed = CASES[name][0], CASES[name][4]
    worst = 0.0
    for rank, result in enumerate(ranks[world]):
        for key, ours in result[name].items():
            reference = _split(expected["packed" if packed else "whole"][key], rank, world, packed).float()
            worst = max(worst, float((ours - reference).norm() / reference.norm()))
    return worst


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[3] is None])
def test_context_parallel_attention_equals_whole_sequence_attention(runs, name):
    tolerance = BF16_TOLERANCE if CASES[name][2] == "bfloat16" else FP32_TOLERANCE
    assert _worst_error(runs, name) < tolerance


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[3] is not None])
def test_broken_variant_is_rejected(runs, name):
    assert _worst_error(runs, name) > 100 * FP32_TOLERANCE
