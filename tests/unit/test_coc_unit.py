"""--use-coc's chunked linears on two gloo ranks: bit-for-bit equal to the unchunked collectives and GEMMs (forward,
input and weight gradients, even and uneven chunks) where the rows are the same per rank; with uneven rows per rank
(MoE experts, empty ones included) equal within GEMM rounding to references built from every rank's data; and the
trace of the work shows the overlap: chunk i is multiplied while the collective of chunk i+1 is issued and not yet
waited for (forward), and each chunk's reduce-scatter is still in flight while the next chunk is multiplied
(backward). Plus chunk bounds, refusals, the linear's arguments bound as the installed megatron-core orders them,
and a GTP-sharded weight (megatron-core 0.19) left to megatron."""

import argparse
import inspect
import os
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from refusals import assert_refused_in_one_line

from mm_adaptor.patches.tensor_parallel import coc

TP, BATCH, HIDDEN, OUT = 2, 2, 8, 12


def test_chunk_bounds_cover_the_rows_unevenly_where_needed():
    assert coc.chunk_bounds(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert coc.chunk_bounds(8, 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert coc.chunk_bounds(3, 8) == [(0, 1), (1, 1), (2, 1)]  # never an empty chunk
    assert coc.chunk_bounds(5, 1) == [(0, 5)]


def options(**kw):
    base = dict(use_coc=True, use_ascend_coc=False, coc_parallel_num=None, tensor_model_parallel_size=2,
                transformer_impl="local")
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw,names", [
    (dict(use_coc=False, coc_parallel_num=4), ["--coc-parallel-num", "--use-coc"]),
    (dict(tensor_model_parallel_size=1), ["--use-coc", "--tensor-model-parallel-size 1"]),
    (dict(tp_comm_overlap=True), ["--use-coc", "--tp-comm-overlap"]),
    (dict(transformer_impl="transformer_engine"), ["--transformer-impl local"]),
])
def test_refusals_are_one_line_naming_the_flags(kw, names):
    assert_refused_in_one_line("coc", options(**kw), names)


def test_the_mindspeed_name_turns_it_on():
    from mm_adaptor.core.features import get

    opts = options(use_coc=False, use_ascend_coc=True)
    assert get("coc").is_enabled(opts)
    get("coc").validate(opts)


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _unchunked_column(x, w, b, group):
    """megatron's path: all-gather, one GEMM; backward: one GEMM, reduce-scatter; weight gradient over all rows."""
    full = x.new_empty((TP * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(full, x.contiguous(), group=group)
    return full, torch.matmul(full, w.t()) + b


def _column_case(rank, rows, chunks, group):
    x = _rand(100 + rank, rows, BATCH, HIDDEN).requires_grad_()
    w = _rand(1, OUT, HIDDEN).requires_grad_()
    b = _rand(2, OUT).requires_grad_()
    grad = _rand(200 + rank, TP * rows, BATCH, OUT)
    out = coc.AllGatherMatmul.apply(x, w, b, False, chunks, group)
    out.backward(grad)
    full, expected = _unchunked_column(x.detach(), w.detach(), b.detach(), group)
    assert torch.equal(out, expected)
    partial = grad.reshape(-1, OUT).mm(w.detach()).view(TP * rows, BATCH, HIDDEN)
    grad_x = torch.empty_like(x)
    dist.reduce_scatter_tensor(grad_x, partial, group=group)
    assert torch.equal(x.grad, grad_x)
    assert torch.equal(w.grad, grad.reshape(-1, OUT).t().matmul(full.reshape(-1, HIDDEN)))
    assert torch.equal(b.grad, grad.reshape(-1, OUT).sum(dim=0))


def _row_case(rank, rows, chunks, group, sequence_parallel):
    x = _rand(300 + rank, TP * rows, BATCH, OUT).requires_grad_()
    w = _rand(3, HIDDEN, OUT).requires_grad_()
    out_rows = rows if sequence_parallel else TP * rows
    grad = _rand(400 + rank, out_rows, BATCH, HIDDEN)
    out = coc.MatmulReduce.apply(x, w, False, sequence_parallel, chunks, group)
    out.backward(grad)
    partial = torch.matmul(x.detach(), w.detach().t())
    if sequence_parallel:
        expected = partial.new_empty((rows, BATCH, HIDDEN))
        dist.reduce_scatter_tensor(expected, partial, group=group)
        total_grad = grad.new_empty((TP * rows, BATCH, HIDDEN))
        dist.all_gather_into_tensor(total_grad, grad, group=group)
    else:
        expected = partial.clone()
        dist.all_reduce(expected, group=group)
        total_grad = grad
    assert torch.equal(out, expected)
    assert torch.equal(x.grad, total_grad.matmul(w.detach()))
    assert torch.equal(w.grad, total_grad.reshape(-1, HIDDEN).t().matmul(x.detach().reshape(-1, OUT)))


def _close(actual, expected):
    """Uneven chunks change GEMM sizes, so rows may round differently (an M-tail kernel); a misplaced or missing
    row is far outside this."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def _uneven_cases(rank, counts, chunks, group):
    """Expert rows: each rank holds its own number of rows (2-D tokens), references built from every rank's
    data locally (the sum over two ranks is the same in either order)."""
    offsets = [sum(counts[:r]) for r in range(TP)]
    mine = slice(offsets[rank], offsets[rank] + counts[rank])
    w = _rand(11, OUT, HIDDEN).requires_grad_()
    xs = [_rand(500 + r, counts[r], HIDDEN) for r in range(TP)]
    grads = [_rand(600 + r, sum(counts), OUT) for r in range(TP)]
    x = xs[rank].clone().requires_grad_()
    out = coc.AllGatherMatmul.apply(x, w, None, False, chunks, group, counts)
    out.backward(grads[rank])
    full = torch.cat(xs)
    _close(out, full.mm(w.detach().t()))
    _close(x.grad, sum(g.mm(w.detach()) for g in grads)[mine])
    _close(w.grad, grads[rank].t().mm(full))

    v = _rand(13, HIDDEN, OUT).requires_grad_()
    inputs = [_rand(700 + r, sum(counts), OUT) for r in range(TP)]
    row_grads = [_rand(800 + r, counts[r], HIDDEN) for r in range(TP)]
    y = inputs[rank].clone().requires_grad_()
    out = coc.MatmulReduce.apply(y, v, False, True, chunks, group, counts)
    out.backward(row_grads[rank])
    _close(out, sum(i.mm(v.detach().t()) for i in inputs)[mine])
    gathered = torch.cat(row_grads)
    _close(y.grad, gathered.mm(v.detach()))
    _close(v.grad, gathered.t().mm(inputs[rank]))


def _worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    group = dist.group.WORLD
    try:
        for rows, chunks in ((8, 2), (8, 4), (10, 4), (3, 8), (8, 1)):
            _column_case(rank, rows, chunks, group)
            _row_case(rank, rows, chunks, group, sequence_parallel=True)
            _row_case(rank, rows, chunks, group, sequence_parallel=False)
        for counts, chunks in (([9, 5], 2), ([9, 5], 4), ([1, 6], 4), ([0, 3], 2), ([0, 0], 4)):
            _uneven_cases(rank, counts, chunks, group)
        trace = []
        x = _rand(7, 8, BATCH, HIDDEN).requires_grad_()
        w = _rand(8, OUT, HIDDEN).requires_grad_()
        coc.AllGatherMatmul.apply(x, w, None, False, 4, group, None, trace).sum().backward()
        results[rank] = trace
    finally:
        dist.destroy_process_group()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_traces():
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(_free_port(), results), nprocs=TP, join=True)
    return dict(results)


def test_chunked_linears_equal_the_unchunked_collectives_bit_for_bit(two_rank_traces):
    """Each rank asserted equality inside the spawned processes; reaching here means all cases held."""
    assert sorted(two_rank_traces) == [0, 1]


def _forward_and_backward(trace):
    split = trace.index(("issue all-gather input", 0), 1)  # backward gathers the input again
    return trace[:split], trace[split:]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_chunk_is_multiplied_while_the_next_collective_is_in_flight(two_rank_traces, rank):
    forward, backward = _forward_and_backward(two_rank_traces[rank])
    at = {event: i for i, event in enumerate(forward)}
    for c in range(3):
        assert at[("issue all-gather input", c + 1)] < at[("matmul", c)] < at[("wait all-gather input", c + 1)]
    at = {event: i for i, event in enumerate(backward)}
    for c in range(3):
        assert at[("issue reduce-scatter", c)] < at[("matmul", c + 1)] < at[("wait reduce", c)]
    # the weight gradient runs while the reduce-scatters are still in flight
    assert at[("weight gradient", 3)] < at[("wait reduce", 0)]


class _TwoRanks:
    """A stand-in tensor-parallel group: the wrappers only ask its size before handing it on."""

    @staticmethod
    def size():
        return TP


def _installed_linear():
    from megatron.core.tensor_parallel import layers

    return layers.linear_with_grad_accumulation_and_async_allreduce


def _megatrons_path(ran: list):
    """A stand-in for megatron's linear function with the installed release's signature, noting that it ran."""

    def linear(*args, **kwargs):
        ran.append("megatron")

    linear.__signature__ = inspect.signature(_installed_linear())
    return linear


def _chunked_path(monkeypatch, reached: list):
    class Chunked:
        @staticmethod
        def apply(*args):
            reached.append(args)

    monkeypatch.setattr(coc, "AllGatherMatmul", Chunked)
    monkeypatch.setattr(coc, "MatmulReduce", Chunked)


def test_the_linear_arguments_bind_as_the_installed_release_orders_them(monkeypatch):
    """Positional arguments up to tp_group, in the installed order (0.16's async_grad_allreduce sits before
    tp_group; 0.17 dropped it): the group given reaches the chunked all-gather."""
    ran, reached = [], []
    _chunked_path(monkeypatch, reached)
    names = list(inspect.signature(_installed_linear()).parameters)
    group, x, w = _TwoRanks(), torch.zeros(4, BATCH, HIDDEN), torch.zeros(OUT, HIDDEN)
    values = dict(input=x, weight=w, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                  sequence_parallel=True, grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=group)
    args = tuple(values.get(name) for name in names[:names.index("tp_group") + 1])
    linears = coc.ChunkedLinears(2)
    linears.linear_under_sequence_parallel(_megatrons_path(ran), None, args, {})
    assert not ran and len(reached) == 1
    assert reached[0][0] is x and reached[0][1] is w and reached[0][5] is group
    assert linears.calls == Counter({"column-parallel all-gather": 1})


def test_a_gtp_sharded_weight_takes_megatrons_path(monkeypatch):
    """megatron 0.19's GTP weight rematerialisation (gtp_remat_size > 1) gathers the weight shard inside its own
    autograd function: both linears leave such a weight to megatron."""
    if "gtp_remat_size" not in inspect.signature(_installed_linear()).parameters:
        pytest.skip("the installed megatron-core has no GTP weight rematerialisation")
    ran, reached = [], []
    _chunked_path(monkeypatch, reached)
    linears = coc.ChunkedLinears(2)
    x, w = torch.zeros(4, BATCH, HIDDEN), torch.zeros(OUT, HIDDEN, requires_grad=True)
    kwargs = dict(bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=True,
                  grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=_TwoRanks())
    linears.linear_under_sequence_parallel(_megatrons_path(ran), None, (x, w), dict(kwargs, gtp_remat_size=2))
    row = SimpleNamespace(input_is_parallel=True, explicit_expert_comm=False, weight=w, tp_group=_TwoRanks(),
                          config=SimpleNamespace(_cpu_offloading_context=None), sequence_parallel=True,
                          gradient_accumulation_fusion=False, skip_bias_add=True, bias=None, gtp_remat_size=2)
    linears.row_parallel_forward(lambda *a, **k: ran.append("megatron row"), row, (x,), {})
    assert ran == ["megatron", "megatron row"] and not reached and not linears.calls
    # the same calls without GTP go by chunks
    linears.linear_under_sequence_parallel(_megatrons_path(ran), None, (x, w), dict(kwargs, gtp_remat_size=1))
    row.gtp_remat_size = 1
    linears.row_parallel_forward(lambda *a, **k: ran.append("megatron row"), row, (x,), {})
    assert len(reached) == 2 and sum(linears.calls.values()) == 2
