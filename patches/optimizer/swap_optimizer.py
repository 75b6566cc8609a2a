"""--swap-optimizer: the distributed optimizer's fp32 main-parameter shards (bf16 runs; in fp32 runs they are the
model's own parameters and stay) and Adam's moments live in pinned host memory between steps.

Between steps they are ordinary host tensors, so checkpoint save and load, and reloading main parameters from the
model, read and write them where they are. While megatron hands each main parameter its gradient (prepare_grads) the
main parameter is a device tensor without storage, and its host copy again right after, so a step that does not
follow (an overflow, or from megatron-core 0.19 a ChainedOptimizer whose grad_norm_skip_threshold skips the update)
leaves nothing on the device. The inner optimizer runs over batches of at most `budget_bytes` of
state: batch i + 1 is copied to the device on one stream while batch i is updated, each updated batch goes to the
model (megatron's copy) and back to host memory on another stream; a device buffer is freed only when the copy
out of it has finished (record_stream), and the step waits for the last copy before it returns."""

from __future__ import annotations

import torch

from mm_adaptor.patches.optimizer.batched_step import batches_by_bytes
from mm_adaptor.patches.optimizer.state_holder import HolderPatches, holder_of, main_and_model_pairs

ADAM_BYTES_PER_ELEMENT = 12  # fp32 main parameter and two fp32 moments


def _device_tensor_without_storage(like: torch.Tensor, device) -> torch.Tensor:
    t = torch.empty(like.shape, dtype=like.dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


class SwappedOptimizerState:
    """Main parameters and moments of one megatron optimizer, kept in host memory between steps: the holder's
    policy for both slots (patches.optimizer.state_holder). Invariant: between
    steps every swapped tensor's data is its host copy (a moment the checkpoint loader replaced included), except
    the main parameters inside megatron's prepare_grads (`released`: device tensors without storage, so that they
    take their device gradients)."""

    slots = ("mains", "moments")
    releases_mains = True

    def __init__(self, optimizer, *, budget_bytes: int, backend):
        self.inner = optimizer.optimizer
        self.backend = backend
        self.device = backend.torch_device()
        self.pairs = [(main, model) for main, model in main_and_model_pairs(optimizer) if main is not None]
        self.main_ids = {id(main) for main, _ in self.pairs}
        self.params = [p for group in self.inner.param_groups for p in group["params"]]
        self.budget_bytes = budget_bytes
        self.host: dict[int, torch.Tensor] = {}  # id(tensor) -> its host copy while its data is elsewhere
        self.released: set[int] = set()
        self.steps = 0
        self.bytes_to_device = self.bytes_to_host = 0
        self._fetch, self._store = backend.new_stream(), backend.new_stream()
        for main, _ in self.pairs:
            host = self.new_host_buffer(main)
            host.copy_(main.data)
            main.data = host

    def new_host_buffer(self, t: torch.Tensor) -> torch.Tensor:
        return self.backend.host_buffer(t.numel() * t.element_size()).view(t.dtype).view(t.shape)

    def host_buffer_for(self, t: torch.Tensor) -> torch.Tensor:
        """Where `t` goes back to: the host copy it came from (pinned where the backend pins), else a new one."""
        host = self.host.pop(id(t), None)
        usable = host is not None and host.shape == t.shape and (host.is_pinned() or not self.backend.pins_host_memory)
        return host if usable else self.new_host_buffer(t)

    def _moments(self, p) -> list[torch.Tensor]:
        return [v for v in self.inner.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0]

    def _swapped(self, p) -> list[torch.Tensor]:
        return ([p] if id(p) in self.main_ids else []) + self._moments(p)

    def release_mains_for_grads(self) -> None:
        """Each main parameter becomes a device tensor without storage: megatron can hand it its gradient."""
        for main, _ in self.pairs:
            if id(main) not in self.released:
                self.host[id(main)] = main.data
                main.data = _device_tensor_without_storage(main, self.device)
                self.released.add(id(main))

    def mains_back_to_host(self) -> None:
        for main, _ in self.pairs:
            if id(main) in self.released:
                main.data = self.host.pop(id(main))
        self.released.clear()

    # -- the holder's step -------------------------------------------------------------------------------------
    def batch_limit(self):
        return self.budget_bytes, ADAM_BYTES_PER_ELEMENT

    def batches(self) -> list[list[int]]:
        return batches_by_bytes(self.params, self.budget_bytes, ADAM_BYTES_PER_ELEMENT)

    def _to_device(self, tensors):
        """Start copying `tensors` (host-resident, or released main parameters) to the device; the returned
        event marks their arrival."""
        self._fetch.wait_stream(self.backend.current_stream())  # the memory allocated below is free there
        for t in tensors:
            source = self.host[id(t)] if id(t) in self.released else t.data
            self.host[id(t)] = source
            device = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            with self.backend.use_stream(self._fetch):
                device.copy_(source, non_blocking=True)
            if device.device.type != "cpu":
                device.record_stream(self._fetch)
            t.data = device
            self.bytes_to_device += device.numel() * device.element_size()
        self.released.difference_update(id(t) for t in tensors)
        event = self.backend.new_event()
        event.record(self._fetch)
        return event

    def _to_host(self, tensors) -> None:
        self._store.wait_stream(self.backend.current_stream())  # the update has been computed
        for t in tensors:
            host, device = self.host_buffer_for(t), t.data
            with self.backend.use_stream(self._store):
                host.copy_(device, non_blocking=True)
            if device.device.type != "cpu":
                device.record_stream(self._store)  # its memory is reused only after this copy
            t.data = host
            self.bytes_to_host += device.numel() * device.element_size()

    def begin_step(self, batches) -> None:
        self._batches, self._arrived = batches, {}

    def _fetch_batch(self, n) -> None:
        if n < len(self._batches):  # moments exist from the first step on; they are made on the device then
            self._arrived[n] = self._to_device([t for p in self._batches[n] for t in self._swapped(p)])

    def before(self, n) -> None:
        if n == 0:
            self._fetch_batch(0)
        self.backend.current_stream().wait_event(self._arrived.pop(n))
        self._fetch_batch(n + 1)  # overlaps this batch's update

    def after(self, n) -> None:  # the holder copied the batch's main parameters into the model
        self._to_host([t for p in self._batches[n] for t in self._swapped(p)])

    def end_step(self) -> None:
        self._store.synchronize()  # host memory holds every update before anything reads it
        self.mains_back_to_host()
        self.steps += 1

    # -- accounting --------------------------------------------------------------------------------------------
    def state_tensors(self):
        mains = [("optimizer_main_param_bytes", "host", main) for main, _ in self.pairs]
        moments = [("optimizer_moment_bytes", "host", m) for p in self.params for m in self._moments(p)]
        return mains + moments

    def statistics(self) -> dict:
        return {"steps": self.steps, "batches_per_step": len(self.batches()),
                "bytes_to_device": self.bytes_to_device, "bytes_to_host": self.bytes_to_host}


class Patches(HolderPatches):
    """The wrappers that keep an optimizer's main parameters and moments in host memory; `options`: what
    SwappedOptimizerState takes besides the optimizer (budget_bytes); `state_class` for the harness's self-test."""

    def __init__(self, state_class=SwappedOptimizerState, **options):
        super().__init__(**options)
        self.state_class = state_class

    def make_policy(self, optimizer):
        from mm_adaptor import devices

        return self.state_class(optimizer, backend=devices.current_or_chosen(), **self.options)

    @staticmethod
    def prepare_grads(wrapped, instance, args, kwargs):
        holder = holder_of(instance)
        state = holder.mains if holder is not None and isinstance(holder.mains, SwappedOptimizerState) else None
        if state is None:
            return wrapped(*args, **kwargs)
        state.release_mains_for_grads()
        try:
            return wrapped(*args, **kwargs)
        finally:  # whether a step follows is not prepare_grads' to say (overflow; 0.19's skip threshold)
            state.mains_back_to_host()
