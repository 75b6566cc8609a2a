"""A deliberately wrong --reuse-fp32-param, registered only for the harness's self-test (loaded into the training
ranks through MM_ADAPTOR_FEATURE_MODULES): its split keeps the bf16 high half and drops the low bits, so each
step starts from the rounded main parameters. It claims bit-for-bit and must fail."""

from mm_adaptor.versions import contracts
from mm_adaptor.core.features import BIT_FOR_BIT, Feature, Flag, register


@register
class ReuseFp32ParamLosingLowBits(Feature):
    name = "test-reuse-fp32-param-losing-low-bits"
    description = "reuse-fp32-param whose split drops the low 16 bits, claiming bit-for-bit"
    flags = (Flag("--use-test-reuse-fp32-param-losing-low-bits", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        from mm_adaptor.feature_flags.reuse_fp32_param import patch_set
        from mm_adaptor.patches.optimizer.reuse_fp32_param import Patches

        return [patch_set(self.name, Patches(budget_bytes=2**20, keep_low_bits=False))]


# the same upstream functions as reuse-fp32-param's patches: its verified megatron-core versions
contracts.verified_like(ReuseFp32ParamLosingLowBits.name, "reuse-fp32-param")
