"""--use-fused-rmsnorm: the local spec's RMSNorm modules run the native rms_norm kernel."""

from mm_adaptor.features import Feature, FeatureConfigError, Flag, Tolerance, register
from mm_adaptor.patching import Contract, PatchSet


def require_local_spec(feature: Feature, options) -> None:
    impl = getattr(options, "transformer_impl", "local")
    if impl != "local":
        raise FeatureConfigError(f"{feature.main_flag.option} patches megatron's local layer spec; it needs "
                                 f"--transformer-impl local (got {impl}) — Transformer Engine has its own fused kernels")


@register
class FusedRMSNorm(Feature):
    name = "fused-rmsnorm"
    description = ("RMSNorm modules of the local spec (layer norms, final norm, q/k norms) run mm_adaptor::rms_norm: "
                   "one pass each way, fp32 accumulation; works with sequence parallelism")
    flags = (Flag("--use-fused-rmsnorm", description),)
    tolerance = Tolerance(exact=False, rtol=1e-3, atol=5e-4, low_precision_rtol=5e-2, low_precision_atol=1e-2,
                          why="one fused fp32 reduction instead of torch's: fp32-rounding-level differences, which Adam can turn into parameter differences "
                          "up to lr per step on near-zero gradients; bf16: one bf16 ulp")

    def validate(self, options):
        if getattr(options, "normalization", None) != "RMSNorm":
            raise FeatureConfigError("--use-fused-rmsnorm needs --normalization RMSNorm (the model uses "
                                     f"{getattr(options, 'normalization', 'LayerNorm')}): add --normalization RMSNorm "
                                     "or drop --use-fused-rmsnorm")
        require_local_spec(self, options)

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer.fused_ops import torch_norm_new_with_fused_rmsnorm

        ps = PatchSet(self.name)
        ps.wrap("megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__", torch_norm_new_with_fused_rmsnorm,
                contract=Contract(versions=">=0.16.0,<0.17"))
        return [ps]
