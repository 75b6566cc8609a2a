"""--reuse-fp32-param: a bf16 run keeps each fp32 main parameter as the model's own bf16 value (its high half) plus
a 2-byte residual (what restores the exact fp32 word), instead of a separate 4-byte fp32 copy.

Between steps the main parameters' storage is released. The step restores them a bounded batch of parameters at a
time (`budget_bytes` of fp32, or one parameter when it is larger), runs the inner optimizer on that batch, then one
native call per batch (fp32_words.round_split_many) rounds the result into the model as megatron does (nearest,
ties to even, bit for bit) and splits it in the same pass; the join before the step is one call per batch too, so
the calls per step follow the batches, not the parameters. The split is exact for any pair of values: a word whose
difference to its bf16 high half does not fit 16 bits (a tie rounded to even, a NaN) is kept whole in the
parameter's exception buffer, and a device counter says how many there were.

Nothing in the step reads those counters back while the device is still busy. A split batch stays "pending", its
main parameters whole (so nothing is lost however many exceptions it had), until the host finds its counters
copied (a non-blocking copy to pinned memory and an event, polled without waiting); then each parameter's storage
is released, or, where the exceptions outnumbered its buffer, it is split again with room for all of them (its
words are still whole). Pending batches are bounded (`pending_bytes`, one budget by default): only a host that runs
that far ahead of the device waits, on the event of a batch enqueued before the one the device is stepping, which
leaves the device's queue full (`host_waits` counts them). Outside the step (zero_grad, a checkpoint, the
statistics) pending batches are settled, waiting if they must.

Anything else that writes the main parameters (checkpoint load, reloading them from the model) finds them whole on
the device; a checkpoint save, which only reads them, finds them whole in host memory, restored a bounded batch at
a time. Either way they are split (or the host copies dropped) at the next zero_grad or step.

The policy of the holder's "mains" slot (patches.optimizer.state_holder), so it composes with a moments policy
(--virtual-optimizer)."""

from __future__ import annotations

from collections import deque

import torch

from mm_adaptor.ops import fp32_words
from mm_adaptor.ops.fp32_words import exception_capacity
from mm_adaptor.patches.optimizer.batched_step import batches_by_bytes
from mm_adaptor.patches.optimizer.state_holder import DISTRIBUTED, FLOAT16, OPTIMIZER, HolderPatches, holder_of, \
    main_and_model_pairs


WHOLE, PENDING, SPLIT = "whole", "pending", "split"


class _Pending:
    """A batch split on the device whose exception counters the host has not read: `on_host` receives them (pinned
    memory on CUDA), `event` (None: already there) says when."""

    __slots__ = ("pairs", "counts", "on_host", "event")

    def __init__(self, pairs, counts):
        self.pairs = pairs
        self.counts = counts
        self.on_host, self.event = counters_to_host(counts)


def counters_to_host(counts: torch.Tensor):
    """(where the host will read `counts`, an event saying when, None: now). CUDA: a non-blocking copy into pinned
    memory and an event after it; the CPU: in place; another device: in place, read waiting."""
    if counts.device.type != "cuda":
        return counts, None
    on_host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    on_host.copy_(counts, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return on_host, event


class ReusedMainParams:
    """The main parameters of one megatron optimizer, kept as residuals of its model parameters: the holder's
    policy for the "mains" slot. Each pair is whole (its main parameter holds the words), pending (whole, and
    split on the device awaiting its counters) or split (the storage released)."""

    slots = ("mains",)
    releases_mains = True
    copies_to_model = True  # after(n) rounds the batch into the model itself, fused with the split

    def __init__(self, pairs, *, budget_bytes: int, keep_low_bits: bool = True, host_device="cpu",
                 pending_bytes: int | None = None):
        self.pairs = [(main, model) for main, model in pairs if main is not None and main.numel()]
        self.index = {id(main): i for i, (main, _) in enumerate(self.pairs)}
        self.budget_bytes = budget_bytes
        self.pending_bytes = budget_bytes if pending_bytes is None else pending_bytes
        self.keep_low_bits = keep_low_bits
        self.host_device = torch.device(host_device)
        n = len(self.pairs)
        self.state = [WHOLE] * n
        # persistent per pair, reused by every split: int16 residuals, exception positions and words, and the
        # one-element device counter of the last split
        self.residual: list = [None] * n
        self.exception_index: list = [None] * n
        self.exception_words: list = [None] * n
        self.count: list = [None] * n
        self.exceptions = [0] * n  # the host's count of each split pair's exceptions
        self.owner: list = [None] * n  # the _Pending a pending pair waits on
        self.pending: deque = deque()
        self.snapshot = False  # the main parameters are read-only host copies; their splits stay valid
        self.steps = 0
        self.host_waits = 0  # blocking reads of counters (see the module docstring)
        self.resplits = 0  # pairs split again because their exceptions outnumbered their buffer
        self.most_joined_bytes = 0  # whole on the device at once for a save
        self._batches: list[list[int]] = []
        self.split_all()

    # -- splitting and joining batches -------------------------------------------------------------------------
    def _whole(self, i) -> bool:
        return self.state[i] != SPLIT

    def _buffers(self, i, capacity: int | None = None) -> None:
        main, model = self.pairs[i]
        if self.residual[i] is None:
            self.residual[i] = torch.empty(main.numel(), dtype=torch.int16, device=model.device)
        if self.exception_index[i] is None or capacity is not None:
            capacity = capacity or exception_capacity(main.numel())
            self.exception_index[i] = torch.empty(capacity, dtype=torch.int64, device=model.device)
            self.exception_words[i] = torch.empty(capacity, dtype=torch.int32, device=model.device)

    def _split(self, indices, round_model: bool) -> None:
        """Split the whole pairs at `indices` in one native call (with round_model, writing the model values
        first, as megatron's copy would); they are pending until their counters are read."""
        if not indices:
            return
        for i in indices:
            self._buffers(i)
        mains = [self.pairs[i][0].detach().view(-1) for i in indices]
        models = [self.pairs[i][1].detach() for i in indices]
        if round_model and not all(model.is_contiguous() for model in models):  # megatron's copy, then the split
            for main, model in zip(mains, models):
                model.copy_(main.view(model.shape))
            round_model = False
        models = [model.view(-1) if model.is_contiguous() else model.reshape(-1) for model in models]
        residuals = [self.residual[i] for i in indices]
        counts = torch.zeros(len(indices), dtype=torch.int64, device=mains[0].device)
        fp32_words.round_split_many(mains, models, residuals, [self.exception_index[i] for i in indices],
                                    [self.exception_words[i] for i in indices], counts, round_model)
        if not self.keep_low_bits:  # the deliberately broken split: low halves and exceptions dropped
            torch._foreach_zero_(residuals)
            counts.zero_()
        pending = _Pending(list(indices), counts)
        for k, i in enumerate(indices):
            self.count[i] = counts[k:k + 1]
            self.state[i], self.owner[i] = PENDING, pending
        self.pending.append(pending)

    def _join(self, indices) -> None:
        """Restore the split pairs at `indices` into their main parameters, in one native call."""
        indices = [i for i in indices if self.state[i] == SPLIT]
        if not indices:
            return
        for i in indices:
            main = self.pairs[i][0]
            main.untyped_storage().resize_(main.numel() * main.element_size())
        self._join_into([self.pairs[i][0].detach().view(-1) for i in indices], indices)
        for i in indices:
            self.state[i] = WHOLE

    def _join_into(self, outs, indices) -> None:
        fp32_words.join_many(outs, [self.pairs[i][1].detach().reshape(-1) for i in indices],
                             [self.residual[i] for i in indices], [self.exception_index[i] for i in indices],
                             [self.exception_words[i] for i in indices], [self.count[i] for i in indices])

    def _keep_whole(self, indices) -> None:
        """Pending pairs become whole (their words are), their split forgotten: nothing to wait for."""
        for i in indices:
            if self.state[i] == PENDING:
                self.state[i], self.owner[i] = WHOLE, None

    # -- reading the counters ----------------------------------------------------------------------------------
    def _owned(self, pending) -> list[int]:
        return [i for i in pending.pairs if self.owner[i] is pending]

    def _pending_nbytes(self) -> int:
        return sum(self.pairs[i][0].numel() * 4 for p in self.pending for i in self._owned(p))

    def _poll(self, wait_over_bytes: int | None) -> None:
        """Resolve the pending batches whose counters have arrived, oldest first; while more than
        `wait_over_bytes` of main parameters are pending, wait for the oldest (None: never wait)."""
        while self.pending:
            pending = self.pending[0]
            if not self._owned(pending):
                self.pending.popleft()
                continue
            ready = pending.event is None or pending.event.query()
            if not ready:
                if wait_over_bytes is None or self._pending_nbytes() <= wait_over_bytes:
                    return
                self.host_waits += 1
                pending.event.synchronize()
            self.pending.popleft()
            self._resolve(pending)

    def settle(self) -> None:
        """Every pending batch resolved (outside the step: waiting where the device is not done)."""
        self._poll(0)

    def _resolve(self, pending) -> None:
        if pending.on_host.device.type != "cpu":
            self.host_waits += 1  # a device without events here: the read waits for it
        counts = pending.on_host.tolist()
        again = []
        for i, count in zip(pending.pairs, counts):
            if self.owner[i] is not pending:
                continue
            self.owner[i] = None
            if count > self.exception_index[i].numel():  # the words are whole: split again with room for all
                self._buffers(i, capacity=max(count, 2 * self.exception_index[i].numel()))
                self.state[i] = WHOLE
                again.append(i)
                continue
            self.exceptions[i] = count
            self.state[i] = SPLIT
            self.pairs[i][0].untyped_storage().resize_(0)
        if again:
            self.resplits += len(again)
            self._split(again, round_model=False)  # the model holds the values the first split rounded

    # -- all pairs ---------------------------------------------------------------------------------------------
    def drop_snapshot(self) -> None:
        """The host copies a save read are dropped; each main parameter is again a device tensor without storage."""
        if not self.snapshot:
            return
        for i, (main, model) in enumerate(self.pairs):
            if not self._whole(i):
                main.data = torch.empty(main.shape, dtype=main.dtype, device=model.device)
                main.untyped_storage().resize_(0)
        self.snapshot = False

    def whole(self) -> None:
        """Every main parameter whole on the device (something may write them); split again at the next
        zero_grad or step."""
        self.drop_snapshot()
        self._keep_whole(range(len(self.pairs)))
        self._poll(None)
        for batch in self.batches():
            self._join(batch)

    join_all = whole

    def readable(self) -> None:
        """Every main parameter readable (a checkpoint save) without all of them whole on the device: a bounded
        batch at a time is joined on the device and copied to host memory. The splits stay valid; the host
        copies go at the next zero_grad or step."""
        if self.snapshot:
            return
        self.settle()
        for batch in self.batches():
            batch = [i for i in batch if not self._whole(i)]
            if not batch:
                continue
            outs = [torch.empty(self.pairs[i][0].shape, dtype=torch.float32, device=self.pairs[i][1].device)
                    for i in batch]
            self._join_into([out.view(-1) for out in outs], batch)
            self.most_joined_bytes = max(self.most_joined_bytes, sum(out.numel() * 4 for out in outs))
            for i, whole in zip(batch, outs):
                self.pairs[i][0].data = whole if whole.device == self.host_device else whole.to(self.host_device)
        self.snapshot = True

    def split_all(self) -> None:
        """Split every whole main parameter against the model values it has (one call per batch), then settle."""
        self.drop_snapshot()
        for batch in self.batches():
            self._split([i for i in batch if self.state[i] == WHOLE], round_model=False)
        self.settle()

    def batches(self) -> list[list[int]]:
        return batches_by_bytes([main for main, _ in self.pairs], self.budget_bytes)

    # -- the holder's step -------------------------------------------------------------------------------------
    def batch_limit(self):
        return self.budget_bytes, 4

    def begin_step(self, batches) -> None:
        self.drop_snapshot()
        self._batches = [[self.index[id(p)] for p in batch if id(p) in self.index] for batch in batches]
        self._poll(None)

    def before(self, n) -> None:
        self._poll(self.pending_bytes)  # release what the device is done with before restoring more
        self._keep_whole(self._batches[n])
        self._join(self._batches[n])

    def after(self, n) -> None:
        """The batch rounded into the model (megatron's copy, which the holder leaves to this policy) and split
        again, in one call; its storage goes once its counters are read."""
        self._split(self._batches[n], round_model=True)
        self._poll(self.pending_bytes)

    def end_step(self) -> None:
        self._poll(None)
        self.steps += 1

    # -- accounting --------------------------------------------------------------------------------------------
    def state_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """What holds the main parameters now (mm_adaptor.devices.memory.STATE_HOLDER): residuals, exception buffers
        and counters, the main parameter while whole or pending, and a save's host copy."""
        held = []
        for i, (main, _model) in enumerate(self.pairs):
            if self._whole(i):
                held.append(("device", main))
            elif self.snapshot:
                held.append(("host", main))
            held += [("device", t) for t in (self.residual[i], self.exception_index[i], self.exception_words[i],
                                             self.count[i]) if t is not None and t.numel()]
        return [("optimizer_main_param_bytes", residence, t) for residence, t in held]

    def statistics(self) -> dict:
        self.settle()
        return {"main_params": len(self.pairs), "main_param_elements": sum(m.numel() for m, _ in self.pairs),
                "exceptions": sum(self.exceptions[i] for i in range(len(self.pairs)) if self.state[i] == SPLIT),
                "exception_capacity": sum(t.numel() for t in self.exception_index if t is not None),
                "batches_per_step": len(self.batches()), "steps": self.steps, "host_waits": self.host_waits,
                "resplits": self.resplits, "most_main_param_bytes_whole_for_a_save": self.most_joined_bytes}


def _reused(optimizer):
    holder = holder_of(optimizer)
    return holder.mains if holder is not None and isinstance(holder.mains, ReusedMainParams) else None


class Patches(HolderPatches):
    """The wrappers that keep an optimizer's main parameters as residuals; `options`: what ReusedMainParams
    takes besides the pairs (budget_bytes, keep_low_bits)."""

    def make_policy(self, optimizer):
        return ReusedMainParams(main_and_model_pairs(optimizer), **self.options) if optimizer.config.bf16 else None

    @staticmethod
    def whole_meanwhile(wrapped, instance, args, kwargs):
        """For methods that write main parameters: they find them whole on the device."""
        reused = _reused(instance)
        if reused is not None:
            reused.whole()
        return wrapped(*args, **kwargs)

    @staticmethod
    def readable_meanwhile(wrapped, instance, args, kwargs):
        """For methods that only read them (a checkpoint save): whole in host memory, a batch at a time."""
        reused = _reused(instance)
        if reused is not None:
            reused.readable()
        return wrapped(*args, **kwargs)

    @staticmethod
    def zero_grad(wrapped, instance, args, kwargs):
        reused = _reused(instance)
        if reused is not None:
            reused.split_all()
        return wrapped(*args, **kwargs)


# Methods that write main parameters outside the step (or read and write them), where each is defined.
WRITERS = (
    f"{OPTIMIZER}.MegatronOptimizer.offload_to_cpu",
    f"{OPTIMIZER}.MegatronOptimizer.restore_from_cpu",
    f"{FLOAT16}.load_state_dict", f"{FLOAT16}._copy_model_params_to_main_params",
    f"{DISTRIBUTED}.load_state_dict", f"{DISTRIBUTED}._copy_main_params_to_param_buffer",
    f"{DISTRIBUTED}._copy_model_params_to_main_params", f"{DISTRIBUTED}.load_parameter_state",
)
# Methods that only read them (a checkpoint save).
READERS = (
    f"{FLOAT16}.state_dict", f"{FLOAT16}.sharded_state_dict", f"{DISTRIBUTED}.sharded_state_dict",
    f"{DISTRIBUTED}.save_parameter_state",
    f"{DISTRIBUTED}.get_parameter_state_dp_zero", f"{DISTRIBUTED}.get_parameter_state_dp_reshardable",
)
ZERO_GRADS = (f"{FLOAT16}.zero_grad", f"{DISTRIBUTED}.zero_grad")
