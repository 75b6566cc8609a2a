"""--swap-optimizer [--swap-optimizer-batch-mb N]: the distributed optimizer's fp32 main-parameter shards and Adam's
moments wait in pinned host memory between steps; the step streams them through the device in batches."""

import math

from mm_adaptor.feature_flags._optimizer_state import BatchedOptimizerStateFeature, state_owner_refusal
from mm_adaptor.core.features import Flag, Tolerance, register
from mm_adaptor.core.verification import (BASE_RELEASE, PIP_0_17_1, TP2_DISTOPT, fake_npu_check, on_one_h100,
                                     same_everywhere)

MAIN = "--swap-optimizer"
BUDGET = "--swap-optimizer-batch-mb"
DEFAULT_BUDGET_MB = 256


def patch_set(name: str, patches):
    from mm_adaptor.patches.optimizer import state_holder as holder

    return holder.holder_patch_set(name, patches, inits=(f"{holder.DISTRIBUTED}.__init__",), extra=[
        (f"{holder.OPTIMIZER}.MixedPrecisionOptimizer.prepare_grads", patches.prepare_grads)])


def refusal_for(options) -> str | None:
    if not getattr(options, "use_distributed_optimizer", False):
        return f"{MAIN} streams the distributed optimizer's shards: add --use-distributed-optimizer"
    return state_owner_refusal(options, MAIN, (("--reuse-fp32-param", "reuse_fp32_param"),
                                                ("--virtual-optimizer", "virtual_optimizer")))


@register
class SwapOptimizer(BatchedOptimizerStateFeature):
    name = "swap-optimizer"
    verified_on = {"0.16.1": BASE_RELEASE, "0.17.1": PIP_0_17_1,
                   "0.19.0": "main parameters back in host memory after prepare_grads (0.19's ChainedOptimizer can "
                             "skip the step); bit for bit on 0.19.2 in dp2-distopt fp32 and bf16"}
    devices = same_everywhere(on_one_h100("--use-distributed-optimizer --bf16, main parameters and moments in host "
                                          "memory"),
                              fake_npu_check(TP2_DISTOPT + " (the fake's streams are synchronous)"))
    refusal_probes = (
        ("without the distributed optimizer", {"swap_optimizer": True}),
        ("with --virtual-optimizer", {"swap_optimizer": True, "use_distributed_optimizer": True,
                                      "virtual_optimizer": math.inf}),
    )
    default_budget_mb = DEFAULT_BUDGET_MB
    wrappers_module = "mm_adaptor.patches.optimizer.swap_optimizer"
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

    refusal = staticmethod(refusal_for)
    patch_set = staticmethod(patch_set)
