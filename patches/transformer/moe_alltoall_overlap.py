"""--moe-alltoall-overlap-comm: megatron's alltoall token dispatcher, with dispatch and combine split into chunks of
local experts whose all-to-alls are in flight while other chunks' experts compute.

A chunk is a contiguous group of this rank's local experts (the same groups on every rank). Its dispatch moves, from
every rank to every rank, the rows of the experts of that group: on the sending side these rows are contiguous per
destination rank in megatron's permuted order (sorted by global expert), so the chunk's send buffer is one row index.
Every chunk's dispatch all-to-all (tokens and routing probabilities) is issued at once, asynchronously; then the
shared experts (when the layer has them) compute; then chunk by chunk: wait for its all-to-all, gather it over the
expert tensor-parallel group (megatron's own function, uneven sizes), sort its rows by local expert, run each of its
experts on exactly the rows megatron gives that expert, in megatron's order, unsort, reduce-scatter over expert TP and
issue its combine all-to-all, asynchronously, before the next chunk computes. The combined rows are put back where
megatron's single combine puts them, and megatron's combine_postprocess unpermutes them.

Backward: an all-to-all's backward is the reverse all-to-all. Each one is a pair of autograd Functions: the wait's
backward issues the reverse all-to-all asynchronously, the issue's backward waits for it; autograd runs the ready node
created last first, so the reverse combine of every chunk is in flight while the last chunk's experts run backward,
and each chunk's reverse dispatch is in flight while the earlier chunks' experts run backward.

Bit for bit: every expert sees exactly its rows in megatron's order (SequentialMLP runs expert by expert anyway); every
reorder is a row copy with a row-copy backward; the only sum this feature changes the order of, the layer input's
gradient from the router, the permutation and the (now later) shared experts, is summed in megatron's order by
`Fanout`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mm_adaptor.patches.transformer.moe_alltoall_chunks import (Chunk, chunk_bounds, counts_of,  # noqa: F401
                                                                  plan)
from mm_adaptor.patches.transformer.moe_alltoall_cost import Link, predict, schedule  # noqa: F401

STATE = "_mm_moe_a2a_overlap"  # on a MoELayer, during one forward: what the wrappers hand each other


# --------------------------------------------------------------------------------------------- autograd pieces


class _Rows(torch.autograd.Function):
    """x[order] with the row copy back as its backward (exact: every row once)."""

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.inverse = inverse
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.inverse), None, None


def _rows(x, order: list[int]):
    index = torch.tensor(order, dtype=torch.long, device=x.device)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(len(order), device=x.device)
    return _Rows.apply(x, index, inverse)


class _Split(torch.autograd.Function):
    """The chunks' send buffers: each chunk's rows of x (together, every row once); backward puts them back."""

    @staticmethod
    def forward(ctx, x, *indices):
        ctx.indices, ctx.shape = indices, x.shape
        return tuple(x.index_select(0, index) for index in indices)

    @staticmethod
    def backward(ctx, *grads):
        full = None
        for index, grad in zip(ctx.indices, grads):
            if grad is None:
                continue
            if full is None:
                full = grad.new_zeros(ctx.shape)
            full.index_copy_(0, index, grad)
        return (full, *[None] * len(ctx.indices))


class _Assemble(torch.autograd.Function):
    """Each chunk's combined rows put where megatron's one combine puts them."""

    @staticmethod
    def forward(ctx, rows, *parts):
        ctx.indices = [index for index in rows]
        first = parts[0]
        out = first.new_empty((sum(p.shape[0] for p in parts), *first.shape[1:]))
        for index, part in zip(ctx.indices, parts):
            out.index_copy_(0, index, part)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, *[grad.index_select(0, index) for index in ctx.indices])


class Fanout(torch.autograd.Function):
    """The layer input given to its three users (the permutation, the router, the shared experts), its gradient
    summed in megatron's order: autograd accumulates the permutation's first, then the router's, then the shared
    experts' (created first, run last); computing the shared experts later would put theirs first."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x), x.view_as(x), x.view_as(x)

    @staticmethod
    def backward(ctx, g_permute, g_router, g_shared):
        total = None
        for g in (g_permute, g_router, g_shared):
            if g is not None:
                total = g if total is None else total + g
        return total


class Transfer:
    """One asynchronous all-to-all and its reverse in backward."""

    def __init__(self, group, send_splits, recv_splits, counts, kind):
        self.group, self.send, self.recv, self.counts, self.kind = group, send_splits, recv_splits, counts, kind
        self.work = self.keep = self.reverse = None

    def start(self, x: torch.Tensor, send, recv) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        self.work = dist.all_to_all_single(out, x, recv, send, group=self.group, async_op=True)
        self.keep = x  # gloo's thread reads it until the wait
        return out

    def finish(self) -> None:
        self.work.wait()
        self.work = self.keep = None


class _Issue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, transfer):
        ctx.transfer = transfer
        out = transfer.start(x, transfer.send, transfer.recv)
        if transfer.counts is not None:
            transfer.counts[f"{transfer.kind} all-to-alls issued async"] += 1
        return out

    @staticmethod
    def backward(ctx, _grad):
        transfer = ctx.transfer
        transfer.finish()  # the reverse all-to-all _Wait's backward issued
        grad, transfer.reverse = transfer.reverse, None
        return grad, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, transfer):
        ctx.transfer = transfer
        transfer.finish()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        transfer = ctx.transfer
        transfer.reverse = transfer.start(grad, transfer.recv, transfer.send)
        if transfer.counts is not None:
            transfer.counts[f"backward {transfer.kind} all-to-alls issued async"] += 1
        # _Issue's backward waits and hands on the reverse all-to-all's output; what passes between the two is
        # only the link in the graph (the output gradient itself, already kept by the transfer)
        return grad, None


def issue(x, group, send, recv, counts=None, kind="dispatch") -> tuple[torch.Tensor, Transfer]:
    transfer = Transfer(group, list(send), list(recv), counts, kind)
    return _Issue.apply(x, transfer), transfer


def wait(out, transfer):
    return _Wait.apply(out, transfer)


# ------------------------------------------------------------------------------------------------- the wrappers


def _dispatcher_served(layer) -> bool:
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    dispatcher = layer.token_dispatcher
    return (type(dispatcher) is MoEAlltoAllTokenDispatcher and isinstance(layer.experts, SequentialMLP)
            and not dispatcher.drop_and_pad and dispatcher.ep_size > 1)


@dataclass
class LayerForward:
    """One forward of one MoE layer under the overlap."""
    shared_input: torch.Tensor | None = None  # the layer input as megatron gave it to shared_experts_compute
    router_input: torch.Tensor | None = None
    permute_input: torch.Tensor | None = None
    compute_shared: object = None  # megatron's shared_experts_compute, deferred
    shared_output: torch.Tensor | None = None
    combined: torch.Tensor | None = None


class Overlap:
    """The wrappers of MoELayer's steps. chunks: how many chunks of local experts (at most the local experts);
    expert_for(j, chunk): the local expert that computes local expert j's rows (the harness's self-test passes a
    wrong one)."""

    def __init__(self, chunks: int, counts, expert_for=None):
        self.chunks, self.counts = chunks, counts
        self.expert_for = expert_for or (lambda j, chunk: j)

    def _state(self, layer) -> LayerForward | None:
        return getattr(layer, STATE, None)

    def shared_experts_compute(self, wrapped, layer, args, kwargs):
        if not _dispatcher_served(layer):
            return wrapped(*args, **kwargs)
        state = LayerForward()
        setattr(layer, STATE, state)
        if not (layer.use_shared_expert and not layer.shared_expert_overlap):
            return wrapped(*args, **kwargs)
        hidden_states = args[0] if args else kwargs["hidden_states"]
        state.shared_input = hidden_states
        if hidden_states.requires_grad:
            state.permute_input, state.router_input, shared = Fanout.apply(hidden_states)
        else:
            state.permute_input = state.router_input = shared = hidden_states
        state.compute_shared = lambda: wrapped(shared)
        return None  # computed while the dispatch is in flight, added by postprocess

    def route(self, wrapped, layer, args, kwargs):
        state = self._state(layer)
        if state is not None and state.router_input is not None and args and args[0] is state.shared_input:
            args = (state.router_input, *args[1:])
        return wrapped(*args, **kwargs)

    def preprocess(self, wrapped, layer, args, kwargs):
        state = self._state(layer)
        if state is not None and state.permute_input is not None and args and args[0] is state.shared_input:
            args = (state.permute_input, *args[1:])
        return wrapped(*args, **kwargs)

    def dispatch(self, wrapped, layer, args, kwargs):
        if self._state(layer) is None:
            return wrapped(*args, **kwargs)
        tokens, probs = _args(args, kwargs, ("hidden_states", "probs"))
        return tokens, probs  # dispatched chunk by chunk in routed_experts_compute

    def routed_experts_compute(self, wrapped, layer, args, kwargs):
        state = self._state(layer)
        if state is None:
            return wrapped(*args, **kwargs)
        tokens, probs = _args(args, kwargs, ("hidden_states", "probs"))
        state.combined = self.pipeline(layer, state, tokens, probs)
        return state.combined, None

    def combine(self, wrapped, layer, args, kwargs):
        state = self._state(layer)
        if state is None or state.combined is None:
            return wrapped(*args, **kwargs)
        return state.combined  # combined chunk by chunk already

    def postprocess(self, wrapped, layer, args, kwargs):
        state = self._state(layer)
        if state is None:
            return wrapped(*args, **kwargs)
        setattr(layer, STATE, None)
        output, shared = _args(args, kwargs, ("output", "shared_expert_output"))
        if shared is None and state.shared_output is not None:
            shared = state.shared_output
        return wrapped(output, shared)

    # the overlapped dispatch, experts and combine
    def pipeline(self, layer, state: LayerForward, tokens, probs):
        from megatron.core.transformer.moe import token_dispatcher as td

        d = layer.token_dispatcher
        counts = self.counts
        d.tokens_per_expert = d._maybe_dtoh_and_synchronize("before_ep_alltoall", d.tokens_per_expert)
        local, matrix = counts_of(d)
        chunks = plan(local, matrix, d.tp_rank, min(self.chunks, d.num_local_experts))
        device = tokens.device
        indices = [torch.tensor(c.send_rows, dtype=torch.long, device=device) for c in chunks]
        token_parts = _Split.apply(tokens, *indices)
        prob_parts = _Split.apply(probs, *indices)
        inflight = []
        for chunk, t_part, p_part in zip(chunks, token_parts, prob_parts):
            sent_t, tt = issue(t_part, d.ep_group, chunk.send_splits, chunk.recv_splits, counts, "dispatch")
            sent_p, tp_ = issue(p_part, d.ep_group, chunk.send_splits, chunk.recv_splits, None, "dispatch")
            inflight.append((sent_t, tt, sent_p, tp_))
        if state.compute_shared is not None:
            state.shared_output = state.compute_shared()
            counts["shared experts computed during the dispatch"] += 1
        d.tokens_per_expert = d._maybe_dtoh_and_synchronize("before_permutation_2", d.tokens_per_expert)
        d._maybe_dtoh_and_synchronize("before_finish", d.tokens_per_expert)
        d.tokens_per_expert = None
        combined = []
        for chunk, (sent_t, tt, sent_p, tp_) in zip(chunks, inflight):
            x, p = wait(sent_t, tt), wait(sent_p, tp_)
            if d.tp_size > 1:
                x = td.gather_from_sequence_parallel_region(x, group=d.tp_group, output_split_sizes=chunk.gather_sizes)
                p = td.gather_from_sequence_parallel_region(p, group=d.tp_group, output_split_sizes=chunk.gather_sizes)
            if len(chunk.tokens_per_expert) > 1:
                x, p = _rows(x, chunk.to_expert_major), _rows(p, chunk.to_expert_major)
            y = self.experts(layer, chunk, x, p)
            if len(chunk.tokens_per_expert) > 1:
                y = _rows(y, chunk.from_expert_major)
            if d.tp_size > 1:
                y = td.reduce_scatter_to_sequence_parallel_region(
                    y.to(d.probs.dtype), group=d.tp_group, input_split_sizes=chunk.gather_sizes).to(y.dtype)
            if len(chunks) > 1:  # a later chunk's dispatch or an earlier chunk's combine not waited for yet
                counts["expert chunks computed with another chunk's all-to-all in flight"] += 1
            combined.append(issue(y, d.ep_group, chunk.recv_splits, chunk.send_splits, counts, "combine"))
        parts = [wait(out, transfer) for out, transfer in combined]
        return _Assemble.apply(indices, *parts)

    def experts(self, layer, chunk: Chunk, x, p):
        """SequentialMLP's loop over the chunk's experts, each on exactly its rows."""
        j0, _ = chunk.experts
        experts = layer.experts.local_experts
        if len(experts) == 1:
            return experts[0](x, p)[0]
        outputs = []
        for i, (rows, probs) in enumerate(zip(torch.split(x, chunk.tokens_per_expert),
                                              torch.split(p, chunk.tokens_per_expert))):
            output, _bias = experts[self.expert_for(j0 + i, chunk)](rows, probs)
            outputs.append(output)
        return torch.cat(outputs, dim=0)


def _args(args, kwargs, names):
    values = list(args)
    for name in names[len(values):]:
        values.append(kwargs[name])
    return values[:len(names)]


def method_wrapper(overlap: Overlap, step: str):
    method = getattr(overlap, step)

    def wrapper(wrapped, instance, args, kwargs):
        return method(wrapped, instance, args, kwargs)

    return wrapper


STEPS = ("shared_experts_compute", "route", "preprocess", "dispatch", "routed_experts_compute", "combine",
         "postprocess")
