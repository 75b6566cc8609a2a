"""--use-fused-rmsnorm: the local spec's RMSNorm modules run the native rms_norm kernel."""

from mm_adaptor.core.features import (Feature, FeatureConfigError, Flag, fused_kernel_tolerance, register,
                                 require_local_spec,
                                  wrap_one)
from mm_adaptor.core.verification import (BASE_RELEASE, ON_0_19_2, H100_SECOND_SESSION, TP2_DISTOPT,
                                     fake_npu_check, on_one_h100, same_everywhere)


@register
class FusedRMSNorm(Feature):
    name = "fused-rmsnorm"
    verified_on = {"0.16.1": BASE_RELEASE,
                   "0.19.0": "WrappedTorchNorm.__new__ gained a return annotation only; " + ON_0_19_2}
    devices = same_everywhere(on_one_h100("fp32, alone, worst 0.40 of the limit", H100_SECOND_SESSION), fake_npu_check(
        TP2_DISTOPT, "npu_rms_norm and npu_rms_norm_backward"))
    refusal_probes = (
        ("memory-efficient layer norm",
         {"use_fused_rmsnorm": True, "normalization": "RMSNorm", "memory_efficient_layer_norm": True}),
    )
    description = ("RMSNorm modules of the local spec (layer norms, final norm, q/k norms) run mm_adaptor::rms_norm: "
                   "one pass each way, fp32 accumulation; works with sequence parallelism and --apply-layernorm-1p "
                   "(zero-centred weight, y = x_hat * (1 + w))")
    flags = (Flag("--use-fused-rmsnorm", description),)
    tolerance = fused_kernel_tolerance("one fused fp32 reduction instead of torch's")

    def validate(self, options):
        if getattr(options, "normalization", None) != "RMSNorm":
            raise FeatureConfigError("--use-fused-rmsnorm needs --normalization RMSNorm (the model uses "
                                     f"{getattr(options, 'normalization', 'LayerNorm')}): add --normalization RMSNorm "
                                     "or drop --use-fused-rmsnorm")
        if getattr(options, "memory_efficient_layer_norm", False):
            from mm_adaptor.patches.transformer.fused_ops import MEMORY_EFFICIENT_NORM_REFUSAL

            raise FeatureConfigError(MEMORY_EFFICIENT_NORM_REFUSAL)
        require_local_spec(self, options)

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer.fused_ops import torch_norm_new_with_fused_rmsnorm

        return wrap_one(self.name, "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
                        torch_norm_new_with_fused_rmsnorm)
