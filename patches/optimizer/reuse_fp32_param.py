"""--reuse-fp32-param: a bf16 run keeps each fp32 main parameter as the model's own bf16 value (its high half) plus
a 2-byte residual (what restores the exact fp32 word), instead of a separate 4-byte fp32 copy.

Between steps the main parameters' storage is released. The step restores them a bounded batch of parameters at a
time (`budget_bytes` of fp32, or one parameter when it is larger), runs the inner optimizer on that batch, copies
the result into the model as megatron does (round to nearest even), splits it again and releases it. The split is
exact for any pair of values: a word whose difference to its bf16 high half does not fit 16 bits (a tie rounded
to even, a NaN) is kept whole in a short exception list.

Anything else that writes the main parameters (checkpoint load, reloading them from the model) finds them whole on
the device; a checkpoint save, which only reads them, finds them whole in host memory, restored a bounded batch at
a time. Either way they are split (or the host copies dropped) at the next zero_grad or step.

The policy of the holder's "mains" slot (patches.optimizer.state_holder), so it composes with a moments policy
(--virtual-optimizer)."""

from __future__ import annotations

import torch

from mm_adaptor.ops.fp32_words import join_fp32_words, split_fp32_words_many
from mm_adaptor.patches.optimizer.batched_step import batches_by_bytes
from mm_adaptor.patches.optimizer.state_holder import DISTRIBUTED, FLOAT16, OPTIMIZER, HolderPatches, holder_of, \
    main_and_model_pairs


def split_words(main: torch.Tensor, model: torch.Tensor, keep_low_bits: bool = True):
    return split_many([(main, model)], keep_low_bits)[0]


def split_many(pairs, keep_low_bits: bool = True):
    """split_fp32_words of each pair with one host synchronisation for all; keep_low_bits=False is the
    deliberately broken split (the low halves lost) that the harness self-test must reject."""
    splits = split_fp32_words_many(pairs)
    if not keep_low_bits:
        for residual, _, _ in splits:
            residual.zero_()
        splits = [(residual, index[:0], kept[:0]) for residual, index, kept in splits]
    return splits


class ReusedMainParams:
    """The main parameters of one megatron optimizer, kept as residuals of its model parameters: the holder's
    policy for the "mains" slot."""

    slots = ("mains",)
    releases_mains = True

    def __init__(self, pairs, *, budget_bytes: int, keep_low_bits: bool = True, host_device="cpu"):
        self.pairs = [(main, model) for main, model in pairs if main is not None and main.numel()]
        self.index = {id(main): i for i, (main, _) in enumerate(self.pairs)}
        self.budget_bytes = budget_bytes
        self.keep_low_bits = keep_low_bits
        self.host_device = torch.device(host_device)
        self.splits: list = [None] * len(self.pairs)
        self.snapshot = False  # the main parameters are read-only host copies; their splits stay valid
        self.steps = 0
        self.most_joined_bytes = 0  # whole on the device at once for a save
        self._batches: list[list[int]] = []
        self.split_all()

    # -- one pair ----------------------------------------------------------------------------------------------
    def _whole(self, i) -> bool:
        return self.splits[i] is None

    def _split(self, indices) -> None:
        """Split the pairs at `indices` (a batch: their counts come to the host together) and release their mains."""
        pairs = [(self.pairs[i][0].detach(), self.pairs[i][1].detach()) for i in indices]
        for i, split in zip(indices, split_many(pairs, self.keep_low_bits)):
            self.splits[i] = split
            self.pairs[i][0].untyped_storage().resize_(0)

    def _join(self, i) -> None:
        main, model = self.pairs[i]
        main.untyped_storage().resize_(main.numel() * main.element_size())
        join_fp32_words(main.detach(), model.detach(), *self.splits[i])
        self.splits[i] = None

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
        for i in range(len(self.pairs)):
            if not self._whole(i):
                self._join(i)

    join_all = whole

    def readable(self) -> None:
        """Every main parameter readable (a checkpoint save) without all of them whole on the device: a bounded
        batch at a time is joined on the device and copied to host memory. The splits stay valid; the host
        copies go at the next zero_grad or step."""
        if self.snapshot:
            return
        for batch in self.batches():
            joined = 0
            for i in batch:
                if self._whole(i):
                    continue
                main, model = self.pairs[i]
                whole = torch.empty(main.shape, dtype=main.dtype, device=model.device)
                join_fp32_words(whole, model.detach(), *self.splits[i])
                joined += whole.numel() * whole.element_size()
                main.data = whole if whole.device == self.host_device else whole.to(self.host_device)
            self.most_joined_bytes = max(self.most_joined_bytes, joined)
        self.snapshot = True

    def split_all(self) -> None:
        """Split every whole main parameter, a batch at a time (one host synchronisation per batch)."""
        self.drop_snapshot()
        for batch in self.batches():
            self._split([i for i in batch if self._whole(i)])

    def batches(self) -> list[list[int]]:
        return batches_by_bytes([main for main, _ in self.pairs], self.budget_bytes)

    # -- the holder's step -------------------------------------------------------------------------------------
    def batch_limit(self):
        return self.budget_bytes, 4

    def begin_step(self, batches) -> None:
        self.drop_snapshot()
        self._batches = [[self.index[id(p)] for p in batch if id(p) in self.index] for batch in batches]

    def before(self, n) -> None:
        for i in self._batches[n]:
            if not self._whole(i):
                self._join(i)

    def after(self, n) -> None:  # the holder copied the batch into the model (megatron's round to nearest even)
        self._split(self._batches[n])

    def end_step(self) -> None:
        self.steps += 1

    # -- accounting --------------------------------------------------------------------------------------------
    def state_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """What holds the main parameters now (mm_adaptor.devices.memory.STATE_HOLDER): residuals and exceptions, the
        main parameter when whole, and a save's host copy."""
        held = []
        for i, (main, _model) in enumerate(self.pairs):
            if self._whole(i):
                held.append(("device", main))
                continue
            held += [("device", t) for t in self.splits[i] if t.numel()]
            if self.snapshot:
                held.append(("host", main))
        return [("optimizer_main_param_bytes", residence, t) for residence, t in held]

    def statistics(self) -> dict:
        return {"main_params": len(self.pairs), "main_param_elements": sum(m.numel() for m, _ in self.pairs),
                "exceptions": sum(s[1].numel() for s in self.splits if s is not None),
                "batches_per_step": len(self.batches()), "steps": self.steps,
                "most_main_param_bytes_whole_for_a_save": self.most_joined_bytes}


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
