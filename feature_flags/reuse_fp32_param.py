"""--reuse-fp32-param: in a bf16 run, each fp32 main parameter is kept as the model's own bf16 value plus a 2-byte
residual, not as a separate 4-byte copy; restored exactly, a batch at a time, for the optimizer step."""

from mm_adaptor.feature_flags._optimizer_state import BatchedOptimizerStateFeature, state_owner_refusal
from mm_adaptor.core.features import Flag, Tolerance, register
from mm_adaptor.core.verification import (BASE_RELEASE, EP2_BF16, PIP_0_17_1, PIP_0_18_2, changed_since_h100,
                                     fake_npu_check, same_everywhere)

MAIN = "--reuse-fp32-param"
BUDGET = "--reuse-fp32-param-batch-mb"
DEFAULT_BUDGET_MB = 256


def patch_set(name: str, patches):
    from mm_adaptor.patches.optimizer import reuse_fp32_param as reuse
    from mm_adaptor.patches.optimizer import state_holder as holder

    return holder.holder_patch_set(name, patches, extra=[
        *((target, patches.zero_grad) for target in reuse.ZERO_GRADS),
        *((target, patches.whole_meanwhile) for target in reuse.WRITERS),
        *((target, patches.readable_meanwhile) for target in reuse.READERS)])


def refusal_for(options) -> str | None:
    """One line naming the flags that cannot work together (the batch flag aside), or None."""
    if getattr(options, "fp16", False):
        return f"{MAIN} keeps fp32 main parameters as bf16 high halves: it needs --bf16, not --fp16"
    if not getattr(options, "bf16", False):
        return f"{MAIN} needs --bf16 (without it there is no separate fp32 main copy to fold away)"
    return state_owner_refusal(options, MAIN, (("--fp8-format", "fp8"), ("--swap-optimizer", "swap_optimizer")))


@register
class ReuseFp32Param(BatchedOptimizerStateFeature):
    name = "reuse-fp32-param"
    verified_on = {"0.16.1": BASE_RELEASE, "0.17.1": PIP_0_17_1, "0.18.0": PIP_0_18_2,
                   "0.19.0": "the wrapped optimizer functions gained Lion, NVFP4 and FSDP branches off the Adam paths "
                             "kept; bit for bit on 0.19.2, checkpoints load both ways"}
    devices = same_everywhere(changed_since_h100(
        "check --layout single --bf16 passed, optimizer main params -50%",
        "issue 53: one multi-tensor round-and-split and one join per batch, counters read without a host sync"),
        fake_npu_check(EP2_BF16))
    refusal_probes = (
        ("without --bf16", {"reuse_fp32_param": True}),
        ("with --fp16", {"reuse_fp32_param": True, "fp16": True}),
        ("with --swap-optimizer", {"reuse_fp32_param": True, "bf16": True, "swap_optimizer": True,
                                   "use_distributed_optimizer": True}),
        ("with --use-precision-aware-optimizer", {"reuse_fp32_param": True, "bf16": True,
                                                  "use_precision_aware_optimizer": True}),
    )
    default_budget_mb = DEFAULT_BUDGET_MB
    wrappers_module = "mm_adaptor.patches.optimizer.reuse_fp32_param"
    description = ("bf16 runs: the fp32 main parameters are kept as the model's bf16 parameters (their high halves) "
                   "plus 2-byte residuals, saving 2 bytes per main-parameter element; the optimizer step restores "
                   "them exactly, a bounded batch at a time")
    flags = (
        Flag(MAIN, description),
        Flag(BUDGET, f"fp32 main parameters restored at once during the step, in MiB (default {DEFAULT_BUDGET_MB}; "
                     "a larger parameter is restored alone)", type=int, default=None),
    )
    tolerance = Tolerance(exact=True, why="the split keeps every bit of each fp32 word, and the same optimizer "
                                          "updates the same values")

    refusal = staticmethod(refusal_for)
    patch_set = staticmethod(patch_set)
