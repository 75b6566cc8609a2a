"""--moe-alltoall-overlap-comm without ranks: the refusals, the chunks' rows and orders against megatron's one
dispatch (simulated for every rank of an EP x TP world), the row-copy autograd pieces, the layer input's gradient in
megatron's order, and the cost model. --moe-permutation-async-comm: its refusal and its CPU no-op."""

import random
import warnings
from types import SimpleNamespace

import pytest
import torch

from mm_adaptor.core.features import fill_defaults, get
from mm_adaptor.patches.transformer import moe_alltoall_overlap as ao
from tests.unit.refusals import assert_refused_in_one_line

MAIN = "--moe-alltoall-overlap-comm"
BASE = dict(moe_alltoall_overlap_comm=True, num_experts=4, expert_model_parallel_size=2,
            moe_token_dispatcher_type="alltoall")


def opts(**kw):
    return fill_defaults(SimpleNamespace(transformer_impl="local", **kw))


@pytest.mark.parametrize("case, names", [
    (dict(moe_alltoall_overlap_chunks=2, num_experts=4), ["--moe-alltoall-overlap-chunks", MAIN]),
    (dict(moe_alltoall_overlap_comm=True), ["--num-experts", MAIN]),
    (dict(BASE, moe_token_dispatcher_type="allgather"), ["allgather", "alltoall"]),
    (dict(BASE, moe_token_dispatcher_type="flex"), ["flex", "alltoall"]),
    (dict(BASE, expert_model_parallel_size=1), ["--expert-model-parallel-size 1"]),
    (dict(BASE, moe_alltoall_overlap_chunks=3), ["--moe-alltoall-overlap-chunks 3", "2"]),
    (dict(BASE, moe_grouped_gemm=True), ["--moe-grouped-gemm", MAIN]),
    (dict(BASE, moe_pad_expert_input_to_capacity=True), ["--moe-pad-expert-input-to-capacity"]),
    (dict(BASE, moe_zero_memory="level0"), ["--moe-zero-memory", MAIN]),
    (dict(BASE, moe_shared_expert_overlap=True), ["--moe-shared-expert-overlap", MAIN]),
    (dict(BASE, overlap_moe_expert_parallel_comm=True), ["--overlap-moe-expert-parallel-comm", MAIN]),
    (dict(BASE, use_coc=True, tensor_model_parallel_size=2), ["--use-coc", "--expert-tensor-parallel-size 1"]),
], ids=["chunks alone", "no experts", "allgather", "flex", "ep1", "chunks > local experts", "grouped gemm",
        "padded capacity", "zero memory", "shared expert overlap", "megatron's ep overlap", "coc with expert tp"])
def test_refusals(case, names):
    assert_refused_in_one_line("moe-alltoall-overlap-comm", opts(**case), names)


def test_accepted():
    get("moe-alltoall-overlap-comm").validate(opts(**BASE, moe_alltoall_overlap_chunks=2))
    get("moe-alltoall-overlap-comm").validate(opts(**BASE, use_coc=True, tensor_model_parallel_size=2,
                                                   expert_tensor_parallel_size=1))
    # --moe-tp-extend-ep lends TP2 to EP: whole experts (expert TP 1) and EP 2, before megatron's arguments are
    # rewritten (validation runs first)
    get("moe-alltoall-overlap-comm").validate(opts(**dict(BASE, expert_model_parallel_size=1), use_coc=True,
                                                   tensor_model_parallel_size=2, moe_tp_extend_ep=True))


def test_permutation_async_refuses_without_experts_and_is_a_recorded_no_op_on_the_cpu(monkeypatch):
    assert_refused_in_one_line("moe-permutation-async-comm", opts(moe_permutation_async_comm=True),
                               ["--num-experts", "--moe-permutation-async-comm"])
    from mm_adaptor import devices

    monkeypatch.setattr(devices, "current", lambda: SimpleNamespace(name="cpu"))
    feature = get("moe-permutation-async-comm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert feature.patch_sets(opts(moe_permutation_async_comm=True, num_experts=4)) == []
    assert len(caught) == 1 and "does nothing on the CPU" in str(caught[0].message)
    assert feature.statistics()["side streams"] == "none on cpu: a no-op"
    # listing the patches (no backend installed): the side-stream wrappers, for the fingerprints
    monkeypatch.setattr(devices, "current", lambda: None)
    [ps] = feature.patch_sets(opts(moe_permutation_async_comm=True, num_experts=4))
    assert sorted(p.target.rsplit(".", 1)[1] for p in ps) == ["permute", "unpermute"]


def test_chunk_bounds():
    assert ao.chunk_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert ao.chunk_bounds(5, 2) == [(0, 3), (3, 5)]
    assert ao.chunk_bounds(3, 1) == [(0, 3)]
    with pytest.raises(ValueError):
        ao.chunk_bounds(2, 3)


def simulate(tp, ep, experts, chunks, seed):
    """Every rank (t, r) routes random counts of labelled tokens; returns, per receiving rank, megatron's rows per
    local expert (one all-to-all, gather over TP, sort by local expert) and the chunked schedule's."""
    rng = random.Random(seed)
    E = ep * experts
    # sent[t][r][e]: the tokens rank (t, r) sends to global expert e, labelled (t, r, e, i)
    sent = [[[[(t, r, e, i) for i in range(rng.randint(0, 3))] for e in range(E)] for r in range(ep)]
            for t in range(tp)]
    megatron, chunked = {}, {}
    for t_me in range(tp):
        for r_me in range(ep):
            mine = range(r_me * experts, (r_me + 1) * experts)
            # megatron: expert j's rows are [(t, r) in t-major order] of what each sends to it
            megatron[t_me, r_me] = [[row for t in range(tp) for r in range(ep) for row in sent[t][r][e]]
                                    for e in mine]
            counts = [[[len(sent[t][r][e]) for e in mine] for r in range(ep)] for t in range(tp)]
            got = [[] for _ in range(experts)]
            plans = {(t, r): ao.plan([len(sent[t][r][e]) for e in range(E)],
                                     [[[len(sent[tt][rr][e]) for e in range(r * experts, (r + 1) * experts)]
                                       for rr in range(ep)] for tt in range(tp)], t, chunks)
                     for t in range(tp) for r in range(ep)}
            mine_plan = ao.plan([len(sent[t_me][r_me][e]) for e in range(E)], counts, t_me, chunks)
            for c, chunk in enumerate(mine_plan):
                # the chunk's all-to-all at each TP rank t: from every EP rank r, its send rows for destination r_me
                gathered = []
                for t in range(tp):
                    for r in range(ep):
                        p = plans[t, r][c]
                        flat = [row for e in range(E) for row in sent[t][r][e]]
                        rows = [flat[i] for i in p.send_rows]
                        start = sum(p.send_splits[:r_me])
                        part = rows[start:start + p.send_splits[r_me]]
                        assert len(part) == plans[t, r_me][c].recv_splits[r]
                        gathered.extend(part)
                assert len(gathered) == sum(chunk.gather_sizes)
                ordered = [gathered[i] for i in chunk.to_expert_major]
                assert [ordered[i] for i in chunk.from_expert_major] == gathered
                j0, j1 = chunk.experts
                at = 0
                for j, n in zip(range(j0, j1), chunk.tokens_per_expert):
                    got[j] = ordered[at:at + n]
                    at += n
            chunked[t_me, r_me] = got
    return megatron, chunked


@pytest.mark.parametrize("tp, ep, experts, chunks", [(1, 2, 2, 2), (1, 4, 2, 2), (2, 2, 2, 2), (2, 2, 4, 3),
                                                     (1, 2, 3, 1), (2, 4, 1, 1)])
def test_each_expert_gets_megatrons_rows_in_megatrons_order(tp, ep, experts, chunks):
    for seed in range(5):
        megatron, chunked = simulate(tp, ep, experts, chunks, seed)
        assert chunked == megatron


def test_receive_splits_match_what_the_senders_send():
    tp, ep, experts, E = 2, 2, 2, 4
    rng = random.Random(0)
    n = [[[rng.randint(0, 4) for _ in range(E)] for _ in range(ep)] for _ in range(tp)]
    for t in range(tp):
        for r_me in range(ep):
            counts = [[n[tt][rr][r_me * experts:(r_me + 1) * experts] for rr in range(ep)] for tt in range(tp)]
            mine = ao.plan(n[t][r_me], counts, t, 2)
            for r in range(ep):
                sender = ao.plan(n[t][r], [[n[tt][rr][r * experts:(r + 1) * experts] for rr in range(ep)]
                                           for tt in range(tp)], t, 2)
                for c in range(2):
                    assert mine[c].recv_splits[r] == sender[c].send_splits[r_me]


def test_split_and_assemble_are_exact_row_copies_both_ways():
    x = torch.randn(7, 3, requires_grad=True)
    idx = [torch.tensor([0, 1, 4]), torch.tensor([2, 3, 5, 6])]
    parts = ao._Split.apply(x, *idx)
    back = ao._Assemble.apply(idx, *parts)
    assert torch.equal(back, x)
    g = torch.randn(7, 3)
    back.backward(g)
    assert torch.equal(x.grad, g)
    y = torch.randn(5, 2, requires_grad=True)
    order = [3, 0, 4, 1, 2]
    out = ao._rows(y, order)
    assert torch.equal(out, y[order])
    out.backward(torch.arange(10.0).reshape(5, 2))
    assert torch.equal(y.grad[order], torch.arange(10.0).reshape(5, 2))


def test_fanout_sums_in_megatrons_order():
    """Autograd accumulates the permutation's gradient first, the router's next, the shared experts' last."""
    torch.manual_seed(0)
    gp, gr, gs = (torch.randn(1000) * 10 ** k for k in (0, 3, -3))
    x = torch.zeros(1000, requires_grad=True)
    p, r, s = ao.Fanout.apply(x)
    torch.autograd.backward([p, r, s], [gp, gr, gs])
    assert torch.equal(x.grad, (gp + gr) + gs)


def test_cost_model():
    link = ao.Link(bandwidth=50e9, latency=20e-6, flops=400e12)
    one = ao.predict(8192, 4096, 1408, 8, 64, 8, 1, link)
    assert one["overlapped s"] == pytest.approx(one["megatron s"]) and one["gain"] == pytest.approx(0)
    four = ao.predict(8192, 4096, 1408, 8, 64, 8, 4, link)
    assert 0 < four["hidden fraction"] <= 1 and four["gain"] > 0
    # the overlap can never beat the longer of communication and compute
    assert four["overlapped s"] >= max(four["comm s"], four["compute s"]) - 1e-12
    # no communication to speak of: nothing to hide, nothing gained beyond rounding
    free = ao.predict(1024, 512, 512, 2, 8, 2, 2, ao.Link(1e18, 0.0, 1e12))
    assert free["gain"] == pytest.approx(0, abs=1e-6)
    # the schedule: two chunks, link 1 per transfer, compute 2 per chunk -> D0 D1 | M0 (1..3) C0 (3..4) | M1 (3..5) C1
    assert ao.schedule([1, 1], [2, 2], [1, 1]) == 6
    assert ao.schedule([1], [2], [1]) == 4
