"""A deliberately wrong --swap-optimizer, registered only for the harness's self-test (loaded into the training
ranks through MM_ADAPTOR_FEATURE_MODULES): tensors of one shape share one host buffer, so a buffer is reused before
the values it holds have been fetched back. It claims bit-for-bit and must fail."""

from mm_adaptor.versions import contracts
from mm_adaptor.core.features import BIT_FOR_BIT, Feature, Flag, register


def _sharing_state_class():
    from mm_adaptor.patches.optimizer.swap_optimizer import SwappedOptimizerState

    class ReusesHostBuffers(SwappedOptimizerState):
        def host_buffer_for(self, t):
            shared = self.__dict__.setdefault("shared", {})
            key = (tuple(t.shape), t.dtype)
            if key not in shared:
                shared[key] = super().host_buffer_for(t)
            self.host.pop(id(t), None)
            return shared[key]

    return ReusesHostBuffers


@register
class SwapOptimizerReusingBuffers(Feature):
    name = "test-swap-optimizer-reusing-buffers"
    description = "swap-optimizer that reuses a host buffer before its values came back, claiming bit-for-bit"
    flags = (Flag("--use-test-swap-optimizer-reusing-buffers", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        from mm_adaptor.feature_flags.swap_optimizer import patch_set
        from mm_adaptor.patches.optimizer.swap_optimizer import Patches

        return [patch_set(self.name, Patches(_sharing_state_class(), budget_bytes=2**20))]


# the same upstream functions as swap-optimizer's patches: its verified megatron-core versions
contracts.verified_like(SwapOptimizerReusingBuffers.name, "swap-optimizer")
