"""A deliberately wrong --use-fused-gmm for megatron-core 0.17+ (SequentialMLP's grouped path), registered only for
the harness's self-test (loaded into the training ranks through MM_ADAPTOR_FEATURE_MODULES): its forward is the
real one, but backward hands each expert the weight gradient of the expert at the mirrored position (the stacked
gradient unbound in reverse order). The losses of step 1 agree; the check must fail on the gradients."""

from mm_adaptor.core.features import Flag, register
from mm_adaptor.feature_flags.fused_gmm import SEQUENTIAL_MLP_FORWARD, FusedGroupedMatmul
from mm_adaptor.patches.transformer import moe_grouped_gemm as native


class MirroredWeightGradients(native.GroupedExpertLinear):
    @staticmethod
    def backward(ctx, dy):
        dx, none, *dw = native.GroupedExpertLinear.backward(ctx, dy)
        return (dx, none, *reversed(dw))


@register
class FusedGmmMirroredWeightGradients(FusedGroupedMatmul):
    name = "test-fused-gmm-mirrored-wgrad"
    description = "--use-fused-gmm's grouped SequentialMLP whose backward gives expert e the mirrored expert's wgrad"
    flags = (Flag("--use-test-fused-gmm-mirrored-wgrad", description),)

    def patch_sets(self, options):
        from mm_adaptor.core.patching import PatchSet

        ps = PatchSet(self.name)
        ps.wrap(SEQUENTIAL_MLP_FORWARD, native.sequential_mlp_forward_grouped(self.grouped, MirroredWeightGradients))
        return [ps]
