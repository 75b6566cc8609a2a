"""--swap-optimizer [--swap-optimizer-batch-mb N]: the distributed optimizer's fp32 main-parameter shards and Adam's
moments wait in pinned host memory between steps; the step streams them through the device in batches."""

from mm_adaptor.features import Feature, FeatureConfigError, Flag, Tolerance, register

MAIN = "--swap-optimizer"
BUDGET = "--swap-optimizer-batch-mb"
DEFAULT_BUDGET_MB = 256
# Megatron flags (and ours) that also decide where the main parameters or moments live.
OWNERS_OF_OPTIMIZER_STATE = (("--use-precision-aware-optimizer", "use_precision_aware_optimizer"),
                             ("--optimizer-cpu-offload", "optimizer_cpu_offload"),
                             ("--use-torch-fsdp2", "use_torch_fsdp2"), ("--use-megatron-fsdp", "use_megatron_fsdp"))


@register
class SwapOptimizer(Feature):
    name = "swap-optimizer"
    description = ("the distributed optimizer's fp32 main-parameter shards (bf16 and fp16 runs) and Adam's moments "
                   "stay in pinned host memory between steps; the step copies batches to the device on one stream "
                   "while the previous batch is updated, and back on another (12 bytes per shard element off the "
                   "device, 8 in fp32 runs)")
    flags = (
        Flag(MAIN, description),
        Flag(BUDGET, f"optimizer state per batch of the step, in MiB (default {DEFAULT_BUDGET_MB}; a larger "
                     "parameter goes alone; two batches are on the device at a time)", type=int, default=None),
    )
    tolerance = Tolerance(exact=True, why="the same Adam updates the same values on the device; copies are exact")

    def is_enabled(self, options) -> bool:
        return bool(getattr(options, "swap_optimizer", False)) or getattr(options, "swap_optimizer_batch_mb",
                                                                          None) is not None

    def validate(self, options):
        refusal = budget_refusal(options, "swap_optimizer", MAIN, BUDGET) or refusal_for(options)
        if refusal:
            raise FeatureConfigError(refusal)

    def patch_sets(self, options):
        from mm_adaptor.patches.optimizer import swap_optimizer as swap

        budget = getattr(options, "swap_optimizer_batch_mb", None)
        self.patches = swap.Patches(budget_bytes=(budget or DEFAULT_BUDGET_MB) * 2**20)
        return [patch_set(self.name, self.patches)]

    def statistics(self):
        patches = getattr(self, "patches", None)
        return patches.statistics() if patches is not None else None


def patch_set(name: str, patches):
    from mm_adaptor.patches.optimizer import reuse_fp32_param as reuse
    from mm_adaptor.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

    contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
    ps = PatchSet(name)
    ps.wrap(f"{reuse.DISTRIBUTED}.__init__", patches.init, contract=contract)
    ps.wrap(f"{reuse.OPTIMIZER}.MixedPrecisionOptimizer.prepare_grads", patches.prepare_grads, contract=contract)
    ps.wrap(reuse.STEP, patches.step_with_ready_grads, contract=contract)
    return ps


def budget_refusal(options, main_dest: str, main_flag: str, budget_flag: str) -> str | None:
    """The batch-size flag of an optimizer-state feature: only with its feature, and at least 1 MiB."""
    budget = getattr(options, budget_flag.lstrip("-").replace("-", "_"), None)
    if budget is not None and not getattr(options, main_dest, False):
        return f"{budget_flag} needs {main_flag}: add {main_flag} or drop {budget_flag}"
    if budget is not None and budget < 1:
        return f"{budget_flag} {budget} is below 1: give the MiB of optimizer state the step handles at once"
    return None


def state_owner_refusal(options, main_flag: str, others: tuple = ()) -> str | None:
    """A flag that also decides where the main parameters or moments live."""
    for flag, dest in (*OWNERS_OF_OPTIMIZER_STATE, *others):
        if getattr(options, dest, None):
            return f"{main_flag} and {flag} both decide where the optimizer's state lives: keep one"
    return None


def refusal_for(options) -> str | None:
    if not getattr(options, "use_distributed_optimizer", False):
        return f"{MAIN} streams the distributed optimizer's shards: add --use-distributed-optimizer"
    return state_owner_refusal(options, MAIN, (("--reuse-fp32-param", "reuse_fp32_param"),
                                                ("--virtual-optimizer", "virtual_optimizer")))
