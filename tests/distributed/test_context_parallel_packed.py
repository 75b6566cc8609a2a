"""Context-parallel attention of a pack (patches/transformer/context_parallel_packed.py) on gloo ranks equals causal
attention within each segment of the whole pack: Ulysses and the ring over 2 ranks, the ring over 4 and hybrid
(Ulysses 2 x ring 2) over 4, with GQA and a segment of one chunk per rank, forward and the gradients of q, k and v,
fp32 (1e-5 relative) and bf16 inputs (1e-2). Broken variants that let attention cross the segments (the ring, Ulysses)
must be rejected. The packed attention's driver path is checked against unpatched Megatron in test_packing.py."""

import pytest
import torch

from gloo_rank import a_rank, run_ranks

from mm_adaptor.core.sequence_split import local_segments

pytestmark = pytest.mark.distributed

SEGMENTS = [16, 8, 24, 8, 8]  # multiples of 2 x 4: at CP 4 the 8s are one token per chunk
HEADS, KV_HEADS, DIM = 4, 2, 8
FP32_TOLERANCE, BF16_TOLERANCE = 1e-5, 1e-2
# name: (ranks, Ulysses degree, dtype, attention crosses the segments)
CASES = {
    "ulysses_2": (2, 2, "float32", False),
    "ring_2": (2, 1, "float32", False),
    "ring_2_bf16": (2, 1, "bfloat16", False),
    "ring_4": (4, 1, "float32", False),
    "hybrid_4": (4, 2, "float32", False),
    "ring_2_across_segments": (2, 1, "float32", True),
    "ulysses_2_across_segments": (2, 2, "float32", True),
}


def _reference(q, k, v):
    """Causal attention within each segment in fp64, the pack [T, 1, heads, d] at once."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    groups = HEADS // KV_HEADS
    outs = []
    for qs, ks, vs in zip(q.split(SEGMENTS), k.split(SEGMENTS), v.split(SEGMENTS)):
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qs.permute(1, 2, 0, 3), ks.repeat_interleave(groups, 2).permute(1, 2, 0, 3),
            vs.repeat_interleave(groups, 2).permute(1, 2, 0, 3), is_causal=True).permute(2, 0, 1, 3))
    return torch.cat(outs), q, k, v


def _rank_main(workdir):
    import torch.distributed as dist

    from mm_adaptor.patches.transformer import context_parallel as cp

    with a_rank(workdir) as (case, results):
        world, rank = dist.get_world_size(), dist.get_rank()
        for name, (ranks, ulysses, dtype, across) in CASES.items():
            if ranks != world:
                continue
            rings = world // ulysses
            ulysses_groups = [dist.new_group(list(range(g * ulysses, (g + 1) * ulysses))) for g in range(rings)]
            ring_groups = [dist.new_group(list(range(j, world, ulysses))) for j in range(ulysses)]
            q, k, v, weight = (local_segments(case[x], rank, world, SEGMENTS).to(getattr(torch, dtype))
                               .requires_grad_() for x in ("q", "k", "v", "weight"))
            out = cp.context_parallel_attention(q, k, v, ulysses_groups[rank // ulysses], ring_groups[rank % ulysses],
                                                packed=(SEGMENTS, world), cross_segments=across)
            (out.float() * weight.float()).sum().backward()
            results[name] = {"out": out.detach().float(), "dq": q.grad.float(), "dk": k.grad.float(),
                             "dv": v.grad.float()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    generator = torch.Generator().manual_seed(0)
    total = sum(SEGMENTS)
    case = {"q": torch.randn(total, 1, HEADS, DIM, generator=generator),
            "k": torch.randn(total, 1, KV_HEADS, DIM, generator=generator),
            "v": torch.randn(total, 1, KV_HEADS, DIM, generator=generator),
            "weight": torch.randn(total, 1, HEADS, DIM, generator=generator)}
    out, q, k, v = _reference(case["q"], case["k"], case["v"])
    (out * case["weight"].double()).sum().backward()
    expected = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    ranks = {n: run_ranks(_rank_main, tmp_path_factory.mktemp(f"packed{n}"), case, nproc=n) for n in (2, 4)}
    return ranks, expected


def _worst_error(runs, name) -> float:
    ranks, expected = runs
    world = CASES[name][0]
    worst = 0.0
    for rank, result in enumerate(ranks[world]):
        for key, ours in result[name].items():
            reference = local_segments(expected[key], rank, world, SEGMENTS).float()
            worst = max(worst, float((ours - reference).norm() / reference.norm()))
    return worst


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c[3]])
def test_packed_context_parallel_attention_equals_attention_within_each_segment(runs, name):
    tolerance = BF16_TOLERANCE if CASES[name][2] == "bfloat16" else FP32_TOLERANCE
    assert _worst_error(runs, name) < tolerance


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[3]])
def test_attention_across_segments_is_rejected(runs, name):
    assert _worst_error(runs, name) > 100 * FP32_TOLERANCE
