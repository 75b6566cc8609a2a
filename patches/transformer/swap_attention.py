"""Swap attention: what the chosen submodules of a transformer layer save for backward is copied to host memory
during forward and copied back, ahead of need, during backward.

Forward, per layer: while a chosen submodule runs, every tensor it saves (on the compute device, at least
`min_bytes`, not a parameter, buffer or other leaf) is packed as a handle on its storage. When the layer has run,
each storage is copied to a pooled host buffer on the offload stream. When the next layer starts (or the block
ends) the device storage is let go: it is freed if autograd was its only holder, and the allocator reuses it only
after the copy has read it (record_stream). A storage something else still holds (the block's input, a shared
table, a tensor a later module saved too) stays on the device and is used from there: nothing is ever freed or
overwritten under another holder.

Backward: when layer L's output gradient arrives (its backward starts), layers L .. L - distance of the same block
pass (micro-batch, virtual stage) are copied back on the prefetch stream into fresh device storage; unpacking
waits for that copy only, and fetches on demand if no prefetch came. Handles rebuild each tensor as a view of the
restored storage, so views that shared a storage share it again.

Which layers swap (`select`): "all" swaps every layer marked at build time. "bandwidth" (the default) never swaps
the last layer of a block pass (the last layer of the model chunk the rank runs: its copy out would turn straight
into a copy back as forward turns into backward) and, of the others, only those whose copy fits the link: the first
MEASURED_PASSES passes of each block (one per micro-batch and virtual stage) swap every candidate and are timed with
the backend's events (device events on CUDA and NPU, the host clock on the CPU); from the next pass on, a layer
swaps only if its copy, at the link's measured rate, ends by the time the next layer's forward ends: its bytes over
the measured bytes per second at most the next layer's forward time (select_layers)."""

from __future__ import annotations

import collections
import functools
import itertools
import weakref

import torch

from mm_adaptor.devices import memory
from mm_adaptor.patches.transformer.swap_attention_select import (  # noqa: F401  (tests and benchmarks use them here)
    DEFAULT_SELECT, MEASURED_PASSES, SELECT_MODES, BlockPlan, LayerTiming, MeasuredLayer, MeasuredPass,
    device_timings, gb_per_s, link_bytes_per_ms, select_layers)
from mm_adaptor.patches.transformer.swap_attention_storage import (  # noqa: F401
    HostPool, StoredStorage, SwappedTensor, _whole_storage)

SWAP_ATTR = "_mm_swap_attention"
DEFAULT_MODULES = ("input_layernorm", "self_attention", "pre_mlp_layernorm")
# TransformerLayer children that can be swapped; MindSpeed's names for the norms are accepted as aliases.
KNOWN_MODULES = ("input_layernorm", "self_attention", "pre_cross_attn_layernorm", "cross_attention",
                 "pre_mlp_layernorm", "mlp")
ALIASES = {"input_norm": "input_layernorm", "post_attention_norm": "pre_mlp_layernorm"}


def module_names(text: str | None) -> tuple[str, ...]:
    """--swap-modules' comma-separated names (aliases resolved, order kept, no repeats); KeyError on unknown."""
    if text is None:
        return DEFAULT_MODULES
    names = []
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            continue
        name = ALIASES.get(raw, raw)
        if name not in KNOWN_MODULES:
            raise KeyError(raw)
        if name not in names:
            names.append(name)
    return tuple(names)


class LayerPass:
    """One forward of one swapped layer: its stored storages, strongly held until released, weakly afterwards
    (they then live exactly as long as autograd's handles)."""

    def __init__(self, block: "BlockPass", layer_number: int, excluded: set[int]):
        self.block, self.layer_number = block, layer_number
        self.excluded = excluded  # storage ids that are never swapped (parameters, buffers, the layer's inputs)
        self.stored: dict[int, StoredStorage] = {}  # by storage id, in the order they were saved
        self.after_release: list[weakref.ref] = []
        self.released = False

    def offload(self, outputs: set[int]) -> int:
        """Start the copies out; the bytes they copy."""
        for storage_id in outputs & self.stored.keys():  # the layer's own output: the next layer needs it
            self.stored[storage_id].state = "kept"
        copied = 0
        for stored in self.stored.values():
            if stored.state == "device":
                stored.offload()
                copied += stored.nbytes if stored.state == "copying" else 0
        return copied

    def release(self) -> None:
        if self.released:
            return
        for stored in self.stored.values():
            stored.release()
        self.after_release = [weakref.ref(s) for s in self.stored.values()]
        self.stored = {}
        self.released = True

    def live(self) -> list[StoredStorage]:
        return [s for s in (ref() for ref in self.after_release) if s is not None]


class BlockPass:
    """One forward of one TransformerBlock (one micro-batch of one virtual stage): its swapped layers, the plan of
    its block, the block's last layer (kept under "bandwidth"), the timing events when measured."""

    def __init__(self, ordinal: int, plan: BlockPlan | None = None, last_layer=None,
                 measured: MeasuredPass | None = None):
        self.ordinal = ordinal
        self.layers: list[LayerPass] = []
        self.plan, self.last_layer, self.measured = plan or BlockPlan(), last_layer, measured

    def release_last(self) -> None:
        if self.layers:
            self.layers[-1].release()


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


class SwapManager:
    """Streams, host pool, the block pass being run, statistics; the wrappers below call into it."""

    def __init__(self, modules=DEFAULT_MODULES, prefetch_distance: int = 1, min_bytes: int = 0,
                 select: str = DEFAULT_SELECT, timings=None):
        """select: "bandwidth" or "all" (see the module's docstring); timings: MeasuredPass -> [LayerTiming], the
        source of the link's rate and the layers' times (device events; tests give stand-ins)."""
        if select not in SELECT_MODES:
            raise ValueError(f"select {select!r}: choose from {', '.join(SELECT_MODES)}")
        self.modules = tuple(modules)
        self.prefetch_distance = prefetch_distance
        self.min_bytes = min_bytes
        self.select = select
        self.timings = timings if timings is not None else device_timings
        self.backend = None
        self.block: BlockPass | None = None
        self.blocks = itertools.count()
        self.plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # block module -> BlockPlan
        self.stats = collections.Counter()

    def _start(self) -> None:
        if self.backend is not None:
            return
        from mm_adaptor import devices

        self.use_backend(devices.current() or devices.install())

    def use_backend(self, backend) -> None:
        self.backend = backend
        self.device = self.backend.torch_device()
        self.offload_stream = self.backend.new_stream()
        self.prefetch_stream = self.backend.new_stream()
        self.pool = HostPool(self.backend)

    def in_use_on(self, tensor: torch.Tensor, side_stream) -> None:
        """Tell the allocator that `side_stream` uses `tensor` (record_stream): its block is not handed out again
        until the work queued there when it is freed has run. The CPU backend's streams are ordered no-ops."""
        if self.backend.name != "cpu":
            tensor.record_stream(side_stream)

    def host_source(self, stored: StoredStorage) -> torch.Tensor:
        """The host copy to bring back into `stored` (its own; the harness's self-test overrides this)."""
        return stored.host

    def statistics(self) -> dict:
        stats = dict(self.stats)
        stats["host_pool_bytes"] = self.pool.allocated_bytes if self.backend is not None else 0
        stats.update(self.selection())
        return stats

    def selection(self) -> dict:
        """select; layers_swapped of layers (per block, summed over this rank's blocks: chosen under "bandwidth" once
        measured, swapped in the measured pass otherwise); link_gb_per_s: bytes over time of the timed copies out
        (None before any); selection_pending: blocks still measuring."""
        plans = list(self.plans.values())
        copied = ms = swapped = layers = pending = 0
        for plan in plans:
            timings = plan.timings
            if timings is None and plan.measured:
                timings = self.timings(plan.measured[-1])
            if timings is None:
                pending += 1
                continue
            copied += sum(t.copied_bytes for t in timings)
            ms += sum(t.copy_ms for t in timings if t.copied_bytes)
            layers += len(timings)
            if plan.chosen is not None:
                swapped += len(plan.chosen)
            else:
                pending += 1 if self.select == "bandwidth" else 0
                swapped += sum(1 for t in timings if t.copied_bytes)
        rate = gb_per_s(copied / ms if copied and ms > 0 else None)
        return {"select": self.select, "layers_swapped": swapped, "layers": layers,
                "link_gb_per_s": None if rate is None else round(rate, 3), "selection_pending": pending}

    def _timing_event(self, stream):
        event = self.backend.stream_module().Event(enable_timing=True)
        event.record(stream)
        return event

    def _plan(self, block_module) -> BlockPlan:
        plan = self.plans.get(block_module)
        if plan is None:
            plan = self.plans[block_module] = BlockPlan()
        return plan

    def _decide(self, plan: BlockPlan) -> None:
        timings = self.timings(plan.measured[-1])
        chosen = select_layers(timings, link_bytes_per_ms(timings))
        plan.timings = timings
        plan.chosen = {t.number for t, take in zip(timings, chosen) if take}
        plan.measured = []

    def _swaps(self, block: BlockPass, layer_module) -> bool:
        if self.select == "all":
            return True
        if layer_module is block.last_layer:
            return False
        return block.plan.chosen is None or layer_module.layer_number in block.plan.chosen

    # TransformerBlock.forward
    def block_forward(self, wrapped, instance, args, kwargs):
        if not torch.is_grad_enabled():
            return wrapped(*args, **kwargs)
        self._start()
        plan = self._plan(instance)
        if plan.chosen is None and self.select == "bandwidth" and len(plan.measured) >= MEASURED_PASSES:
            self._decide(plan)
        measured = None
        if plan.timings is None and len(plan.measured) < MEASURED_PASSES:
            measured = MeasuredPass(self._timing_event(self.backend.current_stream()))
        layers = list(getattr(instance, "layers", None) or [])
        outer = self.block
        self.block = BlockPass(next(self.blocks), plan, layers[-1] if layers else None, measured)
        try:
            output = wrapped(*args, **kwargs)
        except BaseException:
            self.block.release_last()
            self.block = outer
            raise
        self.block.release_last()
        if measured is not None:
            measured.end = self._timing_event(self.backend.current_stream())
            plan.measured.append(measured)
        self.block = outer
        return output

    # TransformerLayer.forward
    def layer_forward(self, wrapped, instance, args, kwargs):
        block = self.block
        if block is None or not torch.is_grad_enabled():
            return wrapped(*args, **kwargs)
        block.release_last()
        if not getattr(instance, SWAP_ATTR, False) or not self._swaps(block, instance):
            if getattr(instance, SWAP_ATTR, False) and instance is block.last_layer:
                self.stats["last_layer_passes_kept"] += 1
            output = wrapped(*args, **kwargs)
            self._note_layer(block, instance)
            return output
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        excluded = {_storage_id(t) for t in itertools.chain(instance.parameters(), instance.buffers())}
        excluded |= {_storage_id(t) for t in _tensors_in((args, kwargs)) if t is not hidden_states}
        layer = LayerPass(block, instance.layer_number, excluded)
        hooks = []
        for name in self.modules:
            child = getattr(instance, name, None)
            if isinstance(child, torch.nn.Module):
                context = torch.autograd.graph.saved_tensors_hooks(functools.partial(self.pack, layer),
                                                                   unpack_saved)
                hooks.append(child.register_forward_pre_hook(functools.partial(_enter, context)))
                hooks.append(child.register_forward_hook(functools.partial(_exit, context), always_call=True))
        try:
            output = wrapped(*args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        measured = self._note_layer(block, instance)
        if measured is not None:
            self.offload_stream.wait_stream(self.backend.current_stream())
            measured.copy_start = self._timing_event(self.offload_stream)
        copied = layer.offload({_storage_id(t) for t in _tensors_in(output)})
        if measured is not None:
            measured.copy_end = self._timing_event(self.offload_stream)
            measured.copied_bytes = copied
        block.layers.append(layer)
        first = output[0] if isinstance(output, tuple) else output
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(functools.partial(self._backward_starts, block, len(block.layers) - 1))
        return output

    def _note_layer(self, block: BlockPass, instance) -> MeasuredLayer | None:
        """In a measured pass: the end of this layer's forward on the compute stream."""
        if block.measured is None:
            return None
        layer = MeasuredLayer(getattr(instance, "layer_number", len(block.measured.layers) + 1),
                              instance is block.last_layer, self._timing_event(self.backend.current_stream()))
        block.measured.layers.append(layer)
        return layer

    def pack(self, layer: LayerPass, t):
        packed = self._pack(layer, t)
        memory.notify_saved(packed)
        return packed

    def _pack(self, layer: LayerPass, t):
        if (type(t) is not torch.Tensor or t.layout != torch.strided or t.device != self.device
                or (t.is_leaf and t.requires_grad)):
            return t
        storage = t.untyped_storage()
        storage_id = storage._cdata
        if storage_id in layer.excluded or storage.nbytes() < max(self.min_bytes, 1):
            return t
        stored = layer.stored.get(storage_id)
        if stored is None:
            stored = layer.stored[storage_id] = StoredStorage(self, storage, layer)
        return SwappedTensor(stored, t)

    def _backward_starts(self, block: BlockPass, index: int, _grad):
        for earlier in range(index, max(-1, index - self.prefetch_distance - 1), -1):
            for stored in block.layers[earlier].live():
                stored.prefetch()


def _enter(context, *_hook_args) -> None:  # None: the module's inputs stay as they are
    context.__enter__()


def _exit(context, *_hook_args) -> None:  # None: its output too
    context.__exit__(None, None, None)


def unpack_saved(packed):
    return packed.unpack() if isinstance(packed, SwappedTensor) else packed


def block_init_marking_layers(wrapped, instance, args, kwargs):
    """TransformerBlock.__init__ wrapper: every layer swaps, less those megatron recomputes whole (block method)."""
    from mm_adaptor.patches.transformer.recompute_activation import layers_to_mark

    result = wrapped(*args, **kwargs)
    layers = list(getattr(instance, "layers", []))
    for index in layers_to_mark(len(layers), instance.config, None):
        setattr(layers[index], SWAP_ATTR, True)
    return result
