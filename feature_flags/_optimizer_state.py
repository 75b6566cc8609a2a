"""What the optimizer-state features (--reuse-fp32-param, --swap-optimizer, --virtual-optimizer) share: their
refusals, a feature base that reports its wrappers' statistics, and one for the two whose step handles the
state in batches of --<feature>-batch-mb MiB. Not a feature module (the leading underscore
keeps discovery away)."""

from importlib import import_module

from mm_adaptor.feature_flags._refusals import cuda_graph_refusal
from mm_adaptor.core.features import Feature, FeatureConfigError, Flag

# Megatron flags (and ours) that also decide where the main parameters or moments live.
OWNERS_OF_OPTIMIZER_STATE = (("--use-precision-aware-optimizer", "use_precision_aware_optimizer"),
                             ("--optimizer-cpu-offload", "optimizer_cpu_offload"),
                             ("--use-torch-fsdp2", "use_torch_fsdp2"), ("--use-megatron-fsdp", "use_megatron_fsdp"))


class OptimizerStateFeature(Feature):
    """A feature whose patch_sets() keeps its wrappers (a patches.optimizer HolderPatches) in self.patches."""

    def statistics(self):
        patches = getattr(self, "patches", None)
        return patches.statistics() if patches is not None else None


class BatchedOptimizerStateFeature(OptimizerStateFeature):
    """flags = (the feature's switch, its batch size in MiB). Subclasses name wrappers_module (whose Patches take
    budget_bytes) and give refusal(options) and patch_set(name, wrappers)."""

    default_budget_mb: int
    wrappers_module: str

    @property
    def budget_flag(self) -> Flag:
        return self.flags[1]

    def is_enabled(self, options) -> bool:
        return super().is_enabled(options) or getattr(options, self.budget_flag.dest, None) is not None

    def validate(self, options):
        refusal = budget_refusal(options, self.main_flag, self.budget_flag) or self.refusal(options)
        if refusal:
            raise FeatureConfigError(refusal)

    def patch_sets(self, options):
        budget_mb = getattr(options, self.budget_flag.dest, None) or self.default_budget_mb
        self.patches = import_module(self.wrappers_module).Patches(budget_bytes=budget_mb * 2**20)
        return [self.patch_set(self.name, self.patches)]


def budget_refusal(options, main: Flag, budget_flag: Flag) -> str | None:
    """The batch-size flag of an optimizer-state feature: only with its feature, and at least 1 MiB."""
    budget = getattr(options, budget_flag.dest, None)
    if budget is not None and not getattr(options, main.dest, False):
        return f"{budget_flag.option} needs {main.option}: add {main.option} or drop {budget_flag.option}"
    if budget is not None and budget < 1:
        return f"{budget_flag.option} {budget} is below 1: give the MiB of optimizer state the step handles at once"
    return None


def state_owner_refusal(options, main_flag: str, others: tuple = ()) -> str | None:
    """A flag that also decides where the main parameters or moments live, or CUDA graphs (they would replay the
    captured step's state placement)."""
    for flag, dest in (*OWNERS_OF_OPTIMIZER_STATE, *others):
        if getattr(options, dest, None):
            return f"{main_flag} and {flag} both decide where the optimizer's state lives: keep one"
    return cuda_graph_refusal(main_flag, options)
