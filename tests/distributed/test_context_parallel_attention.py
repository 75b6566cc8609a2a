"""Context-parallel causal attention (patches/transformer/context_parallel.py) on gloo ranks equals whole-sequence
attention: Ulysses and the ring over 2 ranks, the ring over 4 and hybrid (Ulysses 2 x ring 2) over 4, with GQA,
forward and the gradients of q, k and v, in fp32 (tolerance 1e-5 relative; measured 2.0e-7 .. 2.4e-7) and bf16
inputs (1e-2; measured 4.1e-3: the blocks compute in fp32, so bf16 differs from the fp64 reference by the rounding
of the inputs, the output and the gradients).
Two broken variants must be rejected: a ring that forgets the causal mask of its diagonal blocks, and Ulysses
that gathers the heads in the wrong order."""

import pytest
import torch

from gloo_rank import a_rank, run_ranks

from mm_adaptor.core.sequence_split import local_half

pytestmark = pytest.mark.distributed

SEQ, BATCH, HEADS, KV_HEADS, DIM = 32, 2, 4, 2, 8
FP32_TOLERANCE, BF16_TOLERANCE = 1e-5, 1e-2
# name: (ranks, Ulysses degree, dtype, broken)
CASES = {
    "ulysses_2": (2, 2, "float32", None),
    "ring_2": (2, 1, "float32", None),
    "ring_2_bf16": (2, 1, "bfloat16", None),
    "ulysses_2_bf16": (2, 2, "bfloat16", None),
    "ring_2_no_diagonal_mask": (2, 1, "float32", "ring_diagonal"),
    "ulysses_2_heads_misordered": (2, 2, "float32", "head_order"),
    "ring_4": (4, 1, "float32", None),
    "hybrid_4": (4, 2, "float32", None),
}


def _reference(q, k, v):
    """Whole-sequence causal attention in fp64: out and the gradients of sum(out * weight)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    groups = HEADS // KV_HEADS
    out = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.repeat_interleave(groups, 2).permute(1, 2, 0, 3),
        v.repeat_interleave(groups, 2).permute(1, 2, 0, 3), is_causal=True).permute(2, 0, 1, 3)
    return out, q, k, v


def _rank_main(workdir):
    import torch.distributed as dist

    from mm_adaptor.patches.transformer import context_parallel as cp

    with a_rank(workdir) as (case, results):
        world, rank = dist.get_world_size(), dist.get_rank()
        for name, (ranks, ulysses, dtype, broken) in CASES.items():
            if ranks != world:
                continue
            rings = world // ulysses
            ulysses_groups = [dist.new_group(list(range(g * ulysses, (g + 1) * ulysses))) for g in range(rings)]
            ring_groups = [dist.new_group(list(range(j, world, ulysses))) for j in range(ulysses)]
            q, k, v, weight = (local_half(case[x], rank, world).to(getattr(torch, dtype)).requires_grad_()
                               for x in ("q", "k", "v", "weight"))
            head_order = list(reversed(range(ulysses))) if broken == "head_order" else None
            out = cp.context_parallel_attention(q, k, v, ulysses_groups[rank // ulysses], ring_groups[rank % ulysses],
                                                diagonal_causal=broken != "ring_diagonal", head_order=head_order)
            (out.float() * weight.float()).sum().backward()
            results[name] = {"out": out.detach().float(), "dq": q.grad.float(), "dk": k.grad.float(),
                             "dv": v.grad.float()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    generator = torch.Generator().manual_seed(0)
    case = {"q": torch.randn(SEQ, BATCH, HEADS, DIM, generator=generator),
            "k": torch.randn(SEQ, BATCH, KV_HEADS, DIM, generator=generator),
            "v": torch.randn(SEQ, BATCH, KV_HEADS, DIM, generator=generator),
            "weight": torch.randn(SEQ, BATCH, HEADS, DIM, generator=generator)}
    out, q, k, v = _reference(case["q"], case["k"], case["v"])
    (out * case["weight"].double()).sum().backward()
    expected = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    ranks = {n: run_ranks(_rank_main, tmp_path_factory.mktemp(f"cp{n}"), case, nproc=n) for n in (2, 4)}
    return ranks, expected


def _worst_error(runs, name) -> float:
    ranks, expected = runs
    world = CASES[name][0]
    worst = 0.0
    for rank, result in enumerate(ranks[world]):
        for key, ours in result[name].items():
            reference = local_half(expected[key], rank, world).float()
            worst = max(worst, float((ours - reference).norm() / reference.norm()))
    return worst


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[3] is None])
def test_context_parallel_attention_equals_whole_sequence_attention(runs, name):
    tolerance = BF16_TOLERANCE if CASES[name][2] == "bfloat16" else FP32_TOLERANCE
    assert _worst_error(runs, name) < tolerance


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[3] is not None])
def test_broken_variant_is_rejected(runs, name):
    assert _worst_error(runs, name) > 100 * FP32_TOLERANCE

