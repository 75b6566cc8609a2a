"""--moe-zero-memory level0|level1: an MoE layer keeps less for its backward, and gets it back by communicating and
computing again.

level0: the experts' input (the tokens the dispatcher delivered to this rank) is not kept. When the backward first
needs it (fc1's weight gradient), it is dispatched again from the layer's input, which the router keeps anyway:
megatron's own dispatch_preprocess, token_dispatch and dispatch_postprocess, run with the dispatcher's state as it
was for that micro-batch. The routed and shared experts' activations are recomputed as
--recompute-activation-function recomputes them.
level1: besides, each expert's fc1 output is not kept: fc1 and the activation are recomputed together (from the
re-dispatched input) when fc2's output gradient arrives. --moe-zero-memory-num-layers N gives level1 to the first N
MoE layers of each block, level0 to the others.

Which layers take part is decided when a block is built (the layers megatron recomputes whole are left alone)."""

from __future__ import annotations

import torch

from mm_adaptor.devices import memory
from mm_adaptor.patches.transformer import recompute_activation as rc

LEVEL_ATTR = "_mm_moe_zero_memory"  # on a MoELayer: "level0" or "level1"
_ROUTE_ATTR = "_mm_moe_zero_memory_route"  # this micro-batch's layer input, routing and dispatcher state


def _mark_moe(moe, level: str) -> None:
    """Give one MoE block its level: its routed experts' MLPs, and its shared experts unless megatron recomputes
    them whole."""
    setattr(moe, LEVEL_ATTR, level)
    scope = rc.WITH_FC1 if level == "level1" else True
    rc.mark_mlp(moe, scope)
    shared = getattr(moe, "shared_experts", None)
    if shared is not None and "shared_experts" not in (getattr(moe.config, "recompute_modules", None) or []):
        rc.mark(shared, scope)


def levels_for(count: int, level: str, level1_layers: int | None) -> list[str]:
    """Each of `count` MoE layers' level: level1 in the first level1_layers (all without it), level0 after."""
    if level != "level1" or level1_layers is None:
        return [level] * count
    return ["level1" if i < level1_layers else "level0" for i in range(count)]


def _mark(layers: list, indices, level: str, level1_layers: int | None) -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    blocks = [moe for moe in (getattr(layers[i], "mlp", None) for i in indices) if isinstance(moe, MoELayer)]
    for moe, moe_level in zip(blocks, levels_for(len(blocks), level, level1_layers)):
        _mark_moe(moe, moe_level)


def block_init_marking(level: str, level1_layers: int | None):
    """TransformerBlock.__init__ (and HybridStack.__init__) wrapper: marks the MoE layers the block does not
    recompute whole."""

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        layers = list(getattr(instance, "layers", []))
        _mark(layers, rc.layers_to_mark(len(layers), instance.config, None), level, level1_layers)
        return result

    return wrapper


def _active(layer) -> bool:
    return bool(getattr(layer, LEVEL_ATTR, None)) and torch.is_grad_enabled() and layer.training


def preprocess_noting_route(statistics=None, redispatch_class=None):
    """MoELayer.preprocess(hidden_states, probs, routing_map) wrapper: notes what a later dispatch starts from.
    redispatch_class: Redispatch unless given (the harness's self-test passes a wrong one)."""

    def wrapper(wrapped, instance, args, kwargs):
        if _active(instance):
            hidden_states, probs, routing_map = _arguments(args, kwargs, ("hidden_states", "probs", "routing_map"))
            state = dict(instance.token_dispatcher.__dict__)
            setattr(instance, _ROUTE_ATTR, (redispatch_class or Redispatch)(
                instance, hidden_states, probs.detach(), routing_map, state, statistics))
        return wrapped(*args, **kwargs)

    return wrapper


def routed_experts_compute_releasing_input(statistics=None):
    """MoELayer.routed_experts_compute wrapper: the experts' input is saved as a way to dispatch it again."""

    def wrapper(wrapped, instance, args, kwargs):
        source = getattr(instance, _ROUTE_ATTR, None)
        if source is None or not _active(instance):
            return wrapped(*args, **kwargs)
        setattr(instance, _ROUTE_ATTR, None)
        delivered = {}

        def note_input(_module, inputs):
            delivered["storage"] = inputs[0].untyped_storage().data_ptr()

        def pack(t):
            storage = delivered.get("storage")
            if storage and t.untyped_storage().data_ptr() == storage:
                packed = Redispatched(source, t)
                source.pending += 1
                if statistics is not None:
                    statistics["saved expert inputs released"] += 1
            else:
                packed = t
            memory.notify_saved(packed)
            return packed

        handle = instance.experts.register_forward_pre_hook(note_input)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                output, bias = wrapped(*args, **kwargs)
        finally:
            handle.remove()
        if output.requires_grad:
            # every rank dispatches again at this point of its backward, whether or not it saved any of the input
            # (a rank whose experts got no token saves none, and the dispatch is a collective)
            output.register_hook(source.before_experts_backward)
        return output, bias

    return wrapper


def _unpack(packed):
    return packed.unpack() if isinstance(packed, Redispatched) else packed


class Redispatch:
    """One micro-batch's expert input in one layer, dispatched again once in backward for all who saved it, and let
    go when the last of them has it (not at the end of the whole backward)."""

    def __init__(self, layer, hidden_states, probs, routing_map, dispatcher_state, statistics=None):
        self.layer, self.hidden_states, self.probs, self.routing_map = layer, hidden_states, probs, routing_map
        self.dispatcher_state = dispatcher_state
        self.statistics = statistics
        self.delivered = None
        self.pending = 0  # saved views not unpacked yet
        self.released = False

    def before_experts_backward(self, grad):
        # (with one local expert its output is this tensor, whose recompute hook, registered first, may have had it)
        if not self.released:
            self.get()
            if not self.pending:  # this rank's experts saved none of it: the collective is all it takes part in
                self.release()
        return grad

    def get(self) -> torch.Tensor:
        if self.released:  # dispatching again on one rank alone would hang the others
            raise RuntimeError("--moe-zero-memory: the experts' input was asked for again after every saved view "
                               "had it")
        if self.delivered is None:
            self.delivered = self.dispatch_again()
            if self.statistics is not None:
                self.statistics["experts' inputs dispatched again"] += 1
        return self.delivered

    def unpacked(self, view: torch.Tensor) -> torch.Tensor:
        self.pending -= 1
        if not self.pending:
            self.release()
        return view

    def release(self) -> None:
        self.delivered, self.released = None, True

    def dispatch_again(self) -> torch.Tensor:
        layer = self.layer
        dispatcher = layer.token_dispatcher
        current = dict(dispatcher.__dict__)
        dispatcher.__dict__.update(self.dispatcher_state)
        try:
            with torch.no_grad():
                tokens, probs = layer.preprocess(self.hidden_states, self.probs, self.routing_map)
                tokens, probs = layer.dispatch(tokens, probs)
                delivered, _, _ = dispatcher.dispatch_postprocess(tokens, probs)
        finally:
            dispatcher.__dict__.clear()
            dispatcher.__dict__.update(current)
        return delivered


class Redispatched:
    """What autograd keeps in place of (a view of) the experts' input."""

    def __init__(self, source: Redispatch, t: torch.Tensor):
        self.source = source
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def unpack(self) -> torch.Tensor:
        return self.source.unpacked(self.source.get().as_strided(self.size, self.stride, self.offset))

    def memory_residence(self) -> tuple[str, object, int]:
        """The bytes this keeps: the layer input the dispatch starts again from (counted once, whoever saved it)."""
        storage = self.source.hidden_states.untyped_storage()
        return "device", (storage.data_ptr(), storage.nbytes()), storage.nbytes()


def _arguments(args, kwargs, names):
    values = list(args)
    for name in names[len(values):]:
        values.append(kwargs[name])
    return values[:len(names)]
