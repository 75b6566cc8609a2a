"""A deliberately wrong --virtual-optimizer, registered only for the harness's self-test (loaded into the training
ranks through MM_ADAPTOR_FEATURE_MODULES): moving a moment to host memory loses its values (the new buffer starts
at zero). It claims bit-for-bit and must fail, in fp32 and bf16."""

from mm_adaptor.versions import contracts
from mm_adaptor.core.features import BIT_FOR_BIT, Feature, Flag, register


@register
class VirtualOptimizerLosingMoments(Feature):
    name = "test-virtual-optimizer-losing-moments"
    description = "virtual-optimizer whose move to host memory zeroes the moments, claiming bit-for-bit"
    flags = (Flag("--use-test-virtual-optimizer-losing-moments", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        import math

        import torch

        from mm_adaptor.feature_flags.virtual_optimizer import patch_set
        from mm_adaptor.patches.optimizer.virtual_optimizer import Patches

        return [patch_set(self.name, Patches(budget_bytes=math.inf, place=torch.zeros_like))]


# the same upstream functions as virtual-optimizer's patches: its verified megatron-core versions
contracts.verified_like(VirtualOptimizerLosingMoments.name, "virtual-optimizer")
