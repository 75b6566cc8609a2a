"""--use-fused-swiglu: the MLP's SwiGLU activation runs the native swiglu kernel."""

from mm_adaptor.features import Feature, FeatureConfigError, Flag, Tolerance, register
from mm_adaptor.feature_flags.fused_rmsnorm import require_local_spec
from mm_adaptor.patching import Contract, PatchSet


@register
class FusedSwiGLU(Feature):
    name = "fused-swiglu"
    description = ("the MLP's SwiGLU (fused-bias and plain paths) runs mm_adaptor::swiglu, which saves only its "
                   "input for backward and recomputes silu there")
    flags = (Flag("--use-fused-swiglu", description),)
    tolerance = Tolerance(exact=False, rtol=1e-3, atol=5e-4, low_precision_rtol=5e-2, low_precision_atol=1e-2,
                          why="silu in fp32 with a polynomial exp (~2 ulp): fp32-rounding-level differences, which Adam can turn into parameter differences "
                          "up to lr per step on near-zero gradients; bf16: one bf16 ulp")

    def validate(self, options):
        if not getattr(options, "swiglu", False):
            raise FeatureConfigError("--use-fused-swiglu needs --swiglu: add --swiglu or drop --use-fused-swiglu")
        require_local_spec(self, options)

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer.fused_ops import mlp_forward_with_fused_swiglu

        ps = PatchSet(self.name)
        ps.wrap("megatron.core.transformer.mlp.MLP.forward", mlp_forward_with_fused_swiglu,
                contract=Contract(versions=">=0.16.0,<0.17"))
        return [ps]
