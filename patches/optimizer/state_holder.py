"""One holder per megatron optimizer decides where its fp32 main parameters live and where Adam's moments live, and
runs one step. The optimizer-state features are policies of it: --reuse-fp32-param keeps the main parameters
(as residuals), --virtual-optimizer the moments (in mapped host memory), --swap-optimizer both (in host memory).
Two features that want the same slot are refused by validation (and by adopt(), should validation be bypassed);
features on different slots compose, because the holder runs one batched step and calls every policy around each
batch.

A policy gives:
    slots                     ("mains",), ("moments",) or both
    releases_mains            the main parameters are not in place after a batch (the holder copies each batch's
                              main parameters into the model before the policy puts them away)
    copies_to_model           (optional, with releases_mains) after(n) writes the batch's model values itself,
                              megatron's rounding, fused with putting the main parameters away: the holder does not
    batch_limit()             (budget_bytes, bytes_per_element) bounding a batch, or None
    begin_step(batches) / before(n) / after(n) / end_step()
    state_tensors(), statistics()

Megatron's step_with_ready_grads stays in charge (its timers, its main-to-model copy, the distributed optimizer's
parameter all-gather): only its inner optimizer's step() goes through the holder, and the main-to-model copy that
follows is skipped when the step already made it batch by batch."""

from __future__ import annotations

import torch

from mm_adaptor.patches.optimizer.batched_step import batches_by_bytes, step_in_batches

SLOTS = ("mains", "moments")


class SlotTaken(RuntimeError):
    pass


def holder_of(optimizer, create: bool = False):
    """The OptimizerStateHolder of a megatron optimizer (mm_adaptor.devices.memory.STATE_HOLDER), made on demand."""
    from mm_adaptor.devices.memory import STATE_HOLDER

    holder = getattr(optimizer, STATE_HOLDER, None)
    if holder is None and create:
        holder = OptimizerStateHolder(optimizer.optimizer)
        setattr(optimizer, STATE_HOLDER, holder)
    return holder


class OptimizerStateHolder:
    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner
        self.slots: dict[str, object] = {}
        self.models_current = False  # the last step already copied the main parameters into the model
        self.in_step = False
        self.steps = 0

    def adopt(self, policy) -> None:
        for slot in policy.slots:
            owner = self.slots.get(slot)
            if owner is not None and owner is not policy:
                raise SlotTaken(f"{type(owner).__name__} and {type(policy).__name__} both keep the optimizer's "
                                f"{slot}; validation should have refused them together")
        for slot in policy.slots:
            self.slots[slot] = policy

    @property
    def policies(self) -> list:
        seen = []
        for slot in SLOTS:
            policy = self.slots.get(slot)
            if policy is not None and policy not in seen:
                seen.append(policy)
        return seen

    @property
    def mains(self):
        return self.slots.get("mains")

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.inner.param_groups for p in group["params"]]

    def batches(self) -> list[list[torch.Tensor]]:
        """The params in batches small enough for every policy (one batch when none bounds them)."""
        params = self.params()
        limits = [limit for limit in (p.batch_limit() for p in self.policies) if limit is not None]
        if not limits:
            return [params]
        elements = min(max(1, int(budget // per_element)) for budget, per_element in limits)
        return [[params[i] for i in batch] for batch in batches_by_bytes(params, elements, 1)]

    @torch.no_grad()
    def step(self, model_of: dict[int, torch.Tensor]) -> None:
        """The inner optimizer's step over batches, each policy around each batch. model_of: id(main) -> the
        model tensor it rounds into (megatron's copy), used when the main policy releases the main parameters."""
        batches = self.batches()
        policies = self.policies
        releases = self.mains is not None and self.mains.releases_mains
        copy_to_model = releases and not getattr(self.mains, "copies_to_model", False)
        for policy in policies:
            policy.begin_step(batches)

        def before(n):
            for policy in policies:
                policy.before(n)

        def after(n):
            if copy_to_model:
                for p in batches[n]:
                    if id(p) in model_of:
                        model_of[id(p)].detach().copy_(p.detach())
            for policy in policies:
                policy.after(n)

        step_in_batches(self.inner, batches, before, after)
        for policy in policies:
            policy.end_step()
        self.models_current = releases
        self.steps += 1

    def state_tensors(self):
        return [t for policy in self.policies for t in policy.state_tensors()]

    def statistics(self) -> dict:
        totals: dict = {}
        for policy in self.policies:
            totals.update(policy.statistics())
        return totals


class _InnerStepThroughHolder:
    """Stands in for the inner optimizer while megatron's step_with_ready_grads runs: step() is the holder's."""

    def __init__(self, inner, holder: OptimizerStateHolder, model_of):
        self._inner, self._holder, self._model_of = inner, holder, model_of

    def step(self, *args, **kwargs):
        self._holder.step(self._model_of)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def main_and_model_pairs(optimizer):
    """(fp32 main, bf16 model values it rounds into) of a Float16OptimizerWithFloat16Params or a
    DistributedOptimizer (there: this rank's shard of each parameter, inside the DDP parameter buffer)."""
    if hasattr(optimizer, "shard_fp32_from_float16_groups"):
        mains, models = optimizer.shard_fp32_from_float16_groups, optimizer.shard_float16_groups
    elif hasattr(optimizer, "fp32_from_float16_groups"):
        mains, models = optimizer.fp32_from_float16_groups, optimizer.float16_groups
    else:
        return []
    return [pair for main_group, model_group in zip(mains, models) for pair in zip(main_group, model_group)
            if pair[0] is not None]


class HolderPatches:
    """Base of an optimizer-state feature's wrappers: adopts its policy into each optimizer's holder (one per
    megatron optimizer) and sums its policies' statistics (steps: the most any took). Subclasses give
    make_policy(optimizer) (None: nothing to keep for this optimizer)."""

    def __init__(self, **options):
        self.options = options
        self.attached: list = []

    def make_policy(self, optimizer):
        raise NotImplementedError

    def init(self, wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        if getattr(instance, "is_stub_optimizer", False) or getattr(instance, "optimizer", None) is None:
            return
        policy = self.make_policy(instance)
        if policy is not None:
            holder_of(instance, create=True).adopt(policy)
            self.attached.append(policy)

    @staticmethod
    def step_with_ready_grads(wrapped, instance, args, kwargs):
        """Megatron's own step (timers, main-to-model copy, parameter all-gather) with its inner optimizer's step
        run by the holder. Every feature wraps this; the outermost wrap does the work."""
        holder = holder_of(instance)
        if holder is None or holder.in_step:
            return wrapped(*args, **kwargs)
        model_of = {id(main): model for main, model in main_and_model_pairs(instance)}
        inner, holder.in_step = instance.optimizer, True
        instance.optimizer = _InnerStepThroughHolder(inner, holder, model_of)
        try:
            return wrapped(*args, **kwargs)
        finally:
            instance.optimizer, holder.in_step = inner, False

    @staticmethod
    def copy_main_params_to_model_params(wrapped, instance, args, kwargs):
        """Megatron's main-to-model copy after the step: made already, batch by batch, when the step released the
        main parameters; otherwise megatron's, with the main parameters whole."""
        holder = holder_of(instance)
        if holder is not None and holder.models_current:
            holder.models_current = False
            return None
        if holder is not None and holder.mains is not None:
            holder.mains.whole()
        return wrapped(*args, **kwargs)

    def statistics(self) -> dict | None:
        if not self.attached:
            return None
        totals: dict = {}
        for policy in self.attached:
            for key, value in policy.statistics().items():
                totals[key] = max(totals.get(key, 0), value) if key == "steps" else totals.get(key, 0) + value
        return totals


OPTIMIZER = "megatron.core.optimizer.optimizer"
DISTRIBUTED = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
FLOAT16 = f"{OPTIMIZER}.Float16OptimizerWithFloat16Params"
INITS = (f"{FLOAT16}.__init__", f"{DISTRIBUTED}.__init__", f"{OPTIMIZER}.FP32Optimizer.__init__")
STEPS = (f"{OPTIMIZER}.MixedPrecisionOptimizer.step_with_ready_grads",
         f"{OPTIMIZER}.FP32Optimizer.step_with_ready_grads")
COPIES_TO_MODEL = (f"{FLOAT16}._copy_main_params_to_model_params", f"{DISTRIBUTED}._copy_main_params_to_model_params")


def holder_patch_set(name: str, patches: HolderPatches, *, inits=INITS, extra=()):
    """The wraps every optimizer-state feature shares (its policy adopted at init; megatron's step, and the
    main-to-model copy after it, through the holder) plus `extra` (target, wrapper) pairs."""
    from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

    contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
    ps = PatchSet(name)
    for target in inits:
        ps.wrap(target, patches.init, contract=contract)
    for target in STEPS:
        ps.wrap(target, patches.step_with_ready_grads, contract=contract)
    for target in COPIES_TO_MODEL:
        ps.wrap(target, patches.copy_main_params_to_model_params, contract=contract)
    for target, wrapper in extra:
        ps.wrap(target, wrapper, contract=contract)
    return ps
