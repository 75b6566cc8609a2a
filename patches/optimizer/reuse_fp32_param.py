"""--reuse-fp32-param: a bf16 run keeps each fp32 main parameter as the model's own bf16 value (its high half) plus
a 2-byte residual (what restores the exact fp32 word), instead of a separate 4-byte fp32 copy.

Between steps the main parameters' storage is released. The step restores them a bounded batch of parameters at a
time (`budget_bytes` of fp32, or one parameter when it is larger), runs the inner optimizer on that batch, copies
the result into the model as megatron does (round to nearest even), splits it again and releases it. The split is
exact for any pair of values: a word whose difference to its bf16 high half does not fit 16 bits (a tie rounded
to even, a NaN) is kept whole in a short exception list.

Anything else that reads or writes the main parameters (checkpoint save and load, reloading them from the model)
finds them whole: they are restored on entry and split again at the next zero_grad (or step)."""

from __future__ import annotations

import torch

from mm_adaptor.patches.optimizer.batched_step import HolderPatches, batches_by_bytes, state_holder, step_in_batches

from mm_adaptor.ops.fp32_words import join_fp32_words, split_fp32_words


def split_words(main: torch.Tensor, model: torch.Tensor, keep_low_bits: bool = True):
    """split_fp32_words; keep_low_bits=False is the deliberately broken split (the low halves lost) that the
    harness self-test must reject."""
    residual, index, kept = split_fp32_words(main, model)
    if not keep_low_bits:
        residual.zero_()
        index, kept = index[:0], kept[:0]
    return residual, index, kept


class ReusedMainParams:
    """The main parameters of one megatron optimizer, kept as residuals of its model parameters."""

    def __init__(self, pairs, inner_optimizer, *, budget_bytes: int, keep_low_bits: bool = True):
        self.pairs = [(main, model) for main, model in pairs if main is not None and main.numel()]
        self.inner = inner_optimizer
        self.budget_bytes = budget_bytes
        self.keep_low_bits = keep_low_bits
        self.splits: list = [None] * len(self.pairs)
        self.steps = 0
        for i in range(len(self.pairs)):
            self._split(i)

    # -- one pair ----------------------------------------------------------------------------------------------
    def _whole(self, i) -> bool:
        return self.splits[i] is None

    def _split(self, i) -> None:
        main, model = self.pairs[i]
        self.splits[i] = split_words(main.detach(), model.detach(), self.keep_low_bits)
        main.untyped_storage().resize_(0)

    def _join(self, i) -> None:
        main, model = self.pairs[i]
        main.untyped_storage().resize_(main.numel() * main.element_size())
        join_fp32_words(main.detach(), model.detach(), *self.splits[i])
        self.splits[i] = None

    # -- all pairs ---------------------------------------------------------------------------------------------
    def join_all(self) -> None:
        for i in range(len(self.pairs)):
            if not self._whole(i):
                self._join(i)

    def split_all(self) -> None:
        for i in range(len(self.pairs)):
            if self._whole(i):
                self._split(i)

    def batches(self) -> list[list[int]]:
        return batches_by_bytes([main for main, _ in self.pairs], self.budget_bytes)

    @torch.no_grad()
    def step(self) -> None:
        """The inner optimizer's step, one batch of restored main parameters at a time; then each batch goes to
        the model (megatron's copy: round to nearest even) and is split again."""
        batches = self.batches()

        def join(n):
            for i in batches[n]:
                if not self._whole(i):
                    self._join(i)

        def copy_to_model_and_split(n):
            for i in batches[n]:
                main, model = self.pairs[i]
                model.detach().copy_(main.detach())
                self._split(i)

        step_in_batches(self.inner, [[self.pairs[i][0] for i in batch] for batch in batches], join,
                        copy_to_model_and_split)
        self.steps += 1

    # -- accounting --------------------------------------------------------------------------------------------
    def state_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """What holds the main parameters now: residuals and exceptions, or the main parameter when kept whole
        (mm_adaptor.memory.STATE_HOLDER)."""
        tensors = []
        for i, (main, _model) in enumerate(self.pairs):
            tensors += [main] if self._whole(i) else [t for t in self.splits[i] if t.numel()]
        return [("optimizer_main_param_bytes", "device", t) for t in tensors]

    def statistics(self) -> dict:
        return {"main_params": len(self.pairs), "main_param_elements": sum(m.numel() for m, _ in self.pairs),
                "exceptions": sum(s[1].numel() for s in self.splits if s is not None),
                "batches_per_step": len(self.batches()), "steps": self.steps}


def main_and_model_pairs(optimizer):
    """(fp32 main, bf16 model values it rounds into) of a Float16OptimizerWithFloat16Params or a
    DistributedOptimizer (there: this rank's shard of each parameter, inside the DDP parameter buffer)."""
    if hasattr(optimizer, "shard_fp32_from_float16_groups"):
        mains, models = optimizer.shard_fp32_from_float16_groups, optimizer.shard_float16_groups
    else:
        mains, models = optimizer.fp32_from_float16_groups, optimizer.float16_groups
    return [pair for main_group, model_group in zip(mains, models) for pair in zip(main_group, model_group)]


class Patches(HolderPatches):
    """The wrappers that keep an optimizer's main parameters as residuals; `options`: what ReusedMainParams
    takes besides the pairs (budget_bytes, keep_low_bits)."""

    def init(self, wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        if getattr(instance, "is_stub_optimizer", False) or not instance.config.bf16:
            return
        self.attach(instance, ReusedMainParams(main_and_model_pairs(instance), instance.optimizer, **self.options))

    @staticmethod
    def step_with_ready_grads(wrapped, instance, args, kwargs):
        reused = state_holder(instance)
        if reused is None:
            return wrapped(*args, **kwargs)
        reused.step()  # megatron's inner step and main-to-model copy, batch by batch
        return True

    @staticmethod
    def whole_meanwhile(wrapped, instance, args, kwargs):
        """For methods that read or write main parameters: they find them whole (split at the next zero_grad)."""
        reused = state_holder(instance)
        if reused is not None:
            reused.join_all()
        return wrapped(*args, **kwargs)

    @staticmethod
    def zero_grad(wrapped, instance, args, kwargs):
        reused = state_holder(instance)
        if reused is not None:
            reused.split_all()
        return wrapped(*args, **kwargs)



OPTIMIZER = "megatron.core.optimizer.optimizer"
DISTRIBUTED = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
FLOAT16 = f"{OPTIMIZER}.Float16OptimizerWithFloat16Params"
# Methods that read or write main parameters outside the step, where each is defined.
READERS_AND_WRITERS = (
    f"{OPTIMIZER}.MegatronOptimizer.offload_to_cpu",
    f"{OPTIMIZER}.MegatronOptimizer.restore_from_cpu",
    f"{FLOAT16}.state_dict", f"{FLOAT16}.sharded_state_dict", f"{FLOAT16}.load_state_dict",
    f"{FLOAT16}._copy_main_params_to_model_params", f"{FLOAT16}._copy_model_params_to_main_params",
    f"{DISTRIBUTED}.sharded_state_dict", f"{DISTRIBUTED}.load_state_dict",
    f"{DISTRIBUTED}._copy_main_params_to_model_params", f"{DISTRIBUTED}._copy_main_params_to_param_buffer",
    f"{DISTRIBUTED}._copy_model_params_to_main_params",
    f"{DISTRIBUTED}.save_parameter_state", f"{DISTRIBUTED}.load_parameter_state",
    f"{DISTRIBUTED}.get_parameter_state_dp_zero", f"{DISTRIBUTED}.get_parameter_state_dp_reshardable",
)
ZERO_GRADS = (f"{FLOAT16}.zero_grad", f"{DISTRIBUTED}.zero_grad")
INITS = (f"{FLOAT16}.__init__", f"{DISTRIBUTED}.__init__")
STEP = f"{OPTIMIZER}.MixedPrecisionOptimizer.step_with_ready_grads"
