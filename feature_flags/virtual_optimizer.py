"""--virtual-optimizer [GB]: Adam's moments in host memory the device addresses directly, updated in place by the
device's Adam; with GB, at most that much per rank (the rest stays on the device)."""

import math

from mm_adaptor.feature_flags._optimizer_state import OptimizerStateFeature, state_owner_refusal
from mm_adaptor.core.features import FeatureConfigError, Flag, Tolerance, register
from mm_adaptor.core.verification import BASE_RELEASE, NO_GPU, NO_NPU, PIP_0_17_1, Record, same_everywhere

MAIN = "--virtual-optimizer"
NPU_REFUSAL = ("refused on the NPU backend: torch_npu's swapped-memory tensors take only fill_, zero_, "
               "npu_apply_adam_w and npu_hans_encode/decode, not the element-wise Adam this feature runs in place; "
               "use --swap-optimizer to keep the optimizer state in host memory")


@register
class VirtualOptimizer(OptimizerStateFeature):
    name = "virtual-optimizer"
    verified_on = {"0.16.1": BASE_RELEASE, "0.17.1": PIP_0_17_1,
                   "0.19.0": "bit for bit on 0.19.2 in tp2 fp32 and dp2-distopt bf16"}
    devices = same_everywhere(
        "mapped host memory (host_mapped_copy): built on one H100, its checks not reached in that session; " + NO_GPU,
        Record("not run", "refused on NPU (host_mapped_copy): torch_npu's swapped-memory tensors take only fill_, "
                          "zero_, npu_apply_adam_w and the hans codecs by its documentation, not the element-wise "
                          "Adam the virtual optimizer runs on them (docs/npu.md); " + NO_NPU))
    refusal_probes = (
        ("negative budget", {"virtual_optimizer": -1.0}),
    )
    description = ("Adam's moments live in host memory mapped into the device's address space (CUDA: mapped pinned "
                   "memory; CPU: host tensors; refused on the NPU), read and written in place by the "
                   "device's Adam; GB: at most that much per rank, the rest stays on the device")
    flags = (Flag(MAIN, description, type=float, default=None, value_optional=True, const=math.inf),)
    tolerance = Tolerance(exact=True, why="the same Adam kernels update the same values, wherever the memory is")

    def is_enabled(self, options) -> bool:
        return getattr(options, "virtual_optimizer", None) is not None

    def can_run_here(self) -> tuple[bool, str]:
        from mm_adaptor import devices

        if devices.current_or_chosen().name == "npu":
            return False, NPU_REFUSAL
        return True, "yes"

    def validate(self, options):
        budget = getattr(options, "virtual_optimizer", None)
        runs, why_not = self.can_run_here()
        refusal = (f"{MAIN} {budget:g} is negative: give the GB of moments per rank to keep in host memory "
                   f"(or no value for all)" if budget is not None and budget < 0 else
                   f"{MAIN}: {why_not}" if not runs else
                   state_owner_refusal(options, MAIN, (("--swap-optimizer", "swap_optimizer"),)))
        if refusal:
            raise FeatureConfigError(refusal)

    def patch_sets(self, options):
        from mm_adaptor.patches.optimizer import virtual_optimizer as virtual

        self.patches = virtual.Patches(budget_bytes=options.virtual_optimizer * 1e9)
        return [patch_set(self.name, self.patches)]


def patch_set(name: str, patches):
    """The wraps that give `patches` every megatron optimizer (fp32 ones included) and their steps."""
    from mm_adaptor.patches.optimizer import state_holder as holder

    return holder.holder_patch_set(name, patches)
