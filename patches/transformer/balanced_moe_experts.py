"""--balanced-moe-experts: the N hottest experts of an MoE layer travel to the tokens instead of the tokens to them.

Per training forward of an MoE layer (or every K-th, --balanced-moe-update-interval), each rank counts the tokens its
router sends to each expert and the EP group gathers the counts; the N experts with the most tokens over the group are
the hot ones (ties: the lower index). Their parameters (fc1, fc2, the biases) are broadcast by the rank that owns them
to every rank of the EP group, and each rank computes the tokens it routed to a hot expert itself, with megatron's own
expert MLP on the copied weights; those tokens leave the routing map the dispatcher gets, so they cross no all-to-all
(or all-gather). Their output is added to the layer's output after megatron's postprocess. In backward the gradients
of the copies are summed on the owner (one reduce per hot expert, in fp32) and join the owner's own gradient of that
expert; the other ranks return none to any parameter.

Every rank computes every hot expert, with zero rows where it routed none, so each rank's autograd graph has the same
collectives in the same order. Only megatron's SequentialMLP experts with expert tensor parallelism 1 are served (the
feature refuses the rest)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

STATE_ATTR = "_mm_balanced_moe"  # on a MoELayer: its LayerState
OUT_TOKENS_ATTR = "_mm_balanced_moe_rows"  # on an alltoall dispatcher, during preprocess: the rows it permutes


# The selection and what it changes: pure functions (tests/unit/test_balanced_moe_experts_unit.py) -----------------

def select_hot(counts: torch.Tensor, n: int) -> list[int]:
    """The n experts with the most tokens over the EP group (counts: [ep ranks, experts]); ties go to the lower
    index. Returned in expert order."""
    total = counts.sum(0).tolist()
    order = sorted(range(len(total)), key=lambda e: (-total[e], e))
    return sorted(order[:n])


def owner_of(expert: int, local_experts: int) -> int:
    """The EP rank (within the EP group) holding an expert: megatron gives rank r experts r*L .. r*L + L - 1."""
    return expert // local_experts


def balance(counts: torch.Tensor, hot: list[int], local_experts: int) -> dict[str, list[int]]:
    """Per EP rank, from the group's counts [ep, experts] (rows routed by rank s to expert e):
    rows: expert rows it computes (its own experts' rows from every rank, or with `hot` its cold experts' rows from
    every rank plus its own rows of every hot expert); sent: rows it sends to other ranks' experts."""
    ep, experts = counts.shape
    c = counts.tolist()
    hot_set = set(hot)
    rows, sent = [], []
    for r in range(ep):
        owned = range(r * local_experts, (r + 1) * local_experts)
        rows.append(sum(c[s][e] for s in range(ep) for e in owned if e not in hot_set)
                    + sum(c[r][e] for e in hot_set))
        sent.append(sum(c[r][e] for e in range(experts) if owner_of(e, local_experts) != r and e not in hot_set))
    return {"rows": rows, "sent": sent}


# The layer's state -----------------------------------------------------------------------------------------------

@dataclass
class LayerState:
    forwards: int = 0  # training forwards of this layer so far (selection every `interval`)
    hot: list[int] = field(default_factory=list)
    pending: torch.Tensor | None = None  # this forward's hot output, for postprocess


def _state(layer) -> LayerState:
    state = layer.__dict__.get(STATE_ATTR)
    if state is None:
        state = LayerState()
        layer.__dict__[STATE_ATTR] = state
    return state


class HotExpertCopy(torch.autograd.Function):
    """forward: the owner's parameters of one expert, broadcast to every rank of the EP group (a copy each);
    backward: the copies' gradients summed on the owner (fp32), which returns them to its parameters; the other ranks
    return none. `anchor` (an empty tensor that requires grad) makes every rank's copy part of its graph, so that
    every rank takes part in the reduce."""

    @staticmethod
    def forward(ctx, anchor, group, owner, is_owner, shapes, dtype, statistics, *sources):
        numels = [int(torch.Size(s).numel()) for s in shapes]
        if is_owner:
            flat = torch.cat([s.detach().reshape(-1) for s in sources])
        else:
            flat = torch.empty(sum(numels), dtype=dtype, device=anchor.device)
        dist.broadcast(flat, src=owner, group=group)
        ctx.group, ctx.owner, ctx.is_owner, ctx.shapes, ctx.numels = group, owner, is_owner, shapes, numels
        ctx.dtype, ctx.statistics, ctx.sources = dtype, statistics, len(sources)
        return tuple(piece.view(shape).clone() for piece, shape in zip(flat.split(numels), shapes))

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([(g if g is not None else torch.zeros(shape, dtype=ctx.dtype, device=_device(grads)))
                          .reshape(-1).float() for g, shape in zip(grads, ctx.shapes)])
        dist.reduce(flat, dst=ctx.owner, group=ctx.group)
        if ctx.statistics is not None:
            ctx.statistics["hot expert gradients returned" if ctx.is_owner else "hot expert gradients sent"] += 1
        if ctx.is_owner:
            returned = tuple(piece.view(shape).to(ctx.dtype) for piece, shape in zip(flat.split(ctx.numels),
                                                                                       ctx.shapes))
        else:
            returned = ()
        return (None,) * 7 + returned


def _device(tensors):
    return next((t.device for t in tensors if t is not None), torch.device("cpu"))


@contextlib.contextmanager
def _without_wgrad_fusion(module):
    """megatron's linear layers accumulate into weight.main_grad under gradient_accumulation_fusion; a copy has no
    main_grad: its gradient goes back through autograd to the owner's reduce instead."""
    linears = [m for m in module.modules() if hasattr(m, "gradient_accumulation_fusion")]
    before = [m.gradient_accumulation_fusion for m in linears]
    for m in linears:
        m.gradient_accumulation_fusion = False
    try:
        yield
    finally:
        for m, value in zip(linears, before):
            m.gradient_accumulation_fusion = value


def _gather_counts(routing_map: torch.Tensor, group) -> torch.Tensor:
    local = routing_map.sum(0).to(torch.int64)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.stack(parts).cpu()


def _note_balance(statistics, counts, hot, local_experts):
    if statistics is None:
        return
    before, after = balance(counts, [], local_experts), balance(counts, hot, local_experts)
    ep = counts.shape[0]
    statistics["selections"] += 1
    statistics["expert rows, busiest rank, unbalanced"] += max(before["rows"])
    statistics["expert rows, busiest rank"] += max(after["rows"])
    statistics["expert rows, mean rank x ranks"] += sum(after["rows"])  # / ranks / selections: the mean
    statistics["rows sent, busiest rank, unbalanced"] += max(before["sent"])
    statistics["rows sent, busiest rank"] += max(after["sent"])
    statistics["rows kept off the dispatch (EP group)"] += sum(before["sent"]) - sum(after["sent"])
    statistics["ranks"] = ep


def hot_experts_output(layer, hidden_states, probs, routing_map, hot, statistics=None,
                       copy_class=HotExpertCopy) -> torch.Tensor:
    """Each of `hot`'s experts on this rank's tokens routed to it, with the weights broadcast by its owner: the
    probability-weighted sum per token ([tokens, hidden]), as megatron's experts and unpermute give it."""
    experts = layer.experts
    local = experts.num_local_experts
    group = layer.ep_group
    ep_rank = dist.get_rank(group)
    template = experts.local_experts[0]
    names = [name for name, _ in template.named_parameters()]
    shapes = [tuple(p.shape) for _, p in template.named_parameters()]
    dtype = next(template.parameters()).dtype
    config = layer.config
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    out = torch.zeros_like(flat)
    anchor = torch.empty(0, device=flat.device, requires_grad=torch.is_grad_enabled())
    for e in hot:
        owner = owner_of(e, local)
        is_owner = owner == ep_rank
        sources = [dict(experts.local_experts[e - owner * local].named_parameters())[n] for n in names] \
            if is_owner else []
        copies = copy_class.apply(anchor, group, dist.get_global_rank(group, owner), is_owner, shapes, dtype,
                                     statistics, *sources)
        rows = routing_map[:, e].nonzero(as_tuple=True)[0]
        x = flat.index_select(0, rows)
        p = probs[:, e].index_select(0, rows)
        if config.moe_apply_probs_on_input:  # as SequentialMLP.forward does
            x = (p.unsqueeze(-1) * x).to(x.dtype)
            p = torch.ones_like(p)
        with _without_wgrad_fusion(template):
            y, _ = torch.func.functional_call(template, dict(zip(names, copies)), (x, p))
        out = out.index_add(0, rows, y.to(out.dtype))
        if statistics is not None:
            statistics["hot experts sent" if is_owner else "hot experts copied in"] += 1
            statistics["rows computed locally"] += int(rows.numel())
            if not is_owner:
                statistics["rows computed on a copy"] += int(rows.numel())
    return out


def active(layer) -> bool:
    return bool(getattr(layer, "training", False)) and hasattr(layer.experts, "local_experts")


def preprocess_balancing(hot_num: int, interval: int, statistics=None, copy_class=HotExpertCopy):
    """MoELayer.preprocess(hidden_states, probs, routing_map) wrapper: picks the hot experts, computes this rank's
    tokens of them with copies, and hands megatron's dispatcher the routing map without them.
    copy_class: HotExpertCopy unless given (the harness's self-test passes a wrong one)."""

    def wrapper(wrapped, instance, args, kwargs):
        if not active(instance):
            return wrapped(*args, **kwargs)
        hidden_states, probs, routing_map = _arguments(args, kwargs, ("hidden_states", "probs", "routing_map"))
        state = _state(instance)
        counts = None
        if state.forwards % interval == 0 or not state.hot:
            counts = _gather_counts(routing_map, instance.ep_group)
            state.hot = select_hot(counts, hot_num)
            _note_balance(statistics, counts, state.hot, instance.experts.num_local_experts)
        state.forwards += 1
        state.pending = hot_experts_output(instance, hidden_states, probs, routing_map, state.hot, statistics,
                                           copy_class)
        cold = routing_map.clone()
        cold[:, state.hot] = False
        if counts is not None:  # known on the host already: no device sync for it
            own = counts[dist.get_rank(instance.ep_group)].tolist()
            rows = sum(c for e, c in enumerate(own) if e not in state.hot)
        else:
            rows = int(cold.sum())
        dispatcher = instance.token_dispatcher
        dispatcher.__dict__[OUT_TOKENS_ATTR] = rows
        try:
            return wrapped(hidden_states, probs, cold)
        finally:
            dispatcher.__dict__.pop(OUT_TOKENS_ATTR, None)

    return wrapper


def alltoall_preprocess_counting_rows(wrapped, instance, args, kwargs):
    """MoEAlltoAllTokenDispatcher.preprocess(routing_map) wrapper: megatron's dropless dispatcher permutes
    tokens x top-k rows, every token's k experts; without the hot experts' rows there are fewer."""
    result = wrapped(*args, **kwargs)
    rows = instance.__dict__.get(OUT_TOKENS_ATTR)
    if rows is not None:
        instance.num_out_tokens = rows
    return result


def postprocess_adding_hot_output(wrapped, instance, args, kwargs):
    """MoELayer.postprocess wrapper: the hot experts' output joins megatron's (after its shared experts)."""
    output = wrapped(*args, **kwargs)
    state = instance.__dict__.get(STATE_ATTR)
    if state is None or state.pending is None:
        return output
    hot, state.pending = state.pending, None
    return output + hot.view(output.shape).to(output.dtype)


def _arguments(args, kwargs, names):
    values = list(args)
    for name in names[len(values):]:
        values.append(kwargs[name])
    return values[:len(names)]
