"""--use-fused-swiglu: the MLP's SwiGLU activation runs the native swiglu kernel."""

from mm_adaptor.core.features import (Feature, FeatureConfigError, Flag, fused_kernel_tolerance, register,
                                      require_local_spec)
from mm_adaptor.core.verification import (BASE_RELEASE, ON_0_19_2, H100_SECOND_SESSION, TP2_DISTOPT,
                                     fake_npu_check, on_one_h100, same_everywhere)


@register
class FusedSwiGLU(Feature):
    name = "fused-swiglu"
    verified_on = {"0.16.1": BASE_RELEASE, "0.19.0": ON_0_19_2}
    devices = same_everywhere(on_one_h100("fp32, alone, worst 0.71 of the limit", H100_SECOND_SESSION), fake_npu_check(
        TP2_DISTOPT, "npu_swiglu and npu_swiglu_backward"))
    description = ("the MLP's SwiGLU (fused-bias and plain paths, MoE experts of SequentialMLP and GroupedMLP "
                   "included) runs mm_adaptor::swiglu, which saves only its input for backward and recomputes silu "
                   "there")
    flags = (Flag("--use-fused-swiglu", description),)
    tolerance = fused_kernel_tolerance("silu in fp32 with a polynomial exp (~2 ulp)")

    def validate(self, options):
        if not getattr(options, "swiglu", False):
            raise FeatureConfigError("--use-fused-swiglu needs --swiglu: add --swiglu or drop --use-fused-swiglu")
        require_local_spec(self, options)

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer import fused_ops
        from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

        contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
        ps = PatchSet(self.name)
        ps.wrap("megatron.core.transformer.mlp.MLP.forward", fused_ops.mlp_forward_with_fused_swiglu, contract=contract)
        from megatron.core.transformer.moe import experts

        if hasattr(experts, "GroupedMLP"):  # megatron-core 0.17 removed it: nothing of it to patch there
            ps.wrap("megatron.core.transformer.moe.experts.GroupedMLP.__init__",
                    fused_ops.grouped_mlp_init_with_fused_swiglu, contract=contract)
        return [ps]
