"""--use-fused-gmm: --moe-grouped-gemm runs on the native grouped_matmul, without Transformer Engine or grouped_gemm."""

from mm_adaptor.features import Feature, FeatureConfigError, Flag, fused_kernel_tolerance, register, require_local_spec

GROUPED_GEMM_UTIL = "megatron.core.transformer.moe.grouped_gemm_util"


@register
class FusedGroupedMatmul(Feature):
    name = "fused-gmm"
    description = ("--moe-grouped-gemm's GroupedMLP runs mm_adaptor::grouped_matmul (one call per expert group, "
                   "any dtype) instead of the grouped_gemm package; works with expert parallelism")
    flags = (Flag("--use-fused-gmm", description),)
    tolerance = fused_kernel_tolerance("per-expert GEMMs on x @ W instead of F.linear(x, W^T) in SequentialMLP")
    # GroupedMLP stores all local experts in two matrices; SequentialMLP one Linear pair per expert.
    changes_parameter_layout = True
    # Megatron-LM asserts compute capability >= 8 for --moe-grouped-gemm (the grouped_gemm package's CUTLASS
    # kernels); the native op has no such limit, so that check runs with the flag hidden.
    megatron_lm_validation_overrides = {"moe_grouped_gemm": False}
    # Unpatched, --moe-grouped-gemm needs the grouped_gemm package: the baseline is SequentialMLP, the same math.
    unpatched_baseline_omits = ("--moe-grouped-gemm",)

    def validate(self, options):
        if not getattr(options, "num_experts", None):
            raise FeatureConfigError("--use-fused-gmm runs MoE experts: add --num-experts (and --moe-grouped-gemm)")
        if not getattr(options, "moe_grouped_gemm", False):
            raise FeatureConfigError("--use-fused-gmm is the kernel behind --moe-grouped-gemm: add --moe-grouped-gemm "
                                     "or drop --use-fused-gmm")
        bias = getattr(options, "add_bias_linear", not getattr(options, "disable_bias_linear", False))
        if bias:
            raise FeatureConfigError("GroupedMLP has no expert biases: add --disable-bias-linear")
        if getattr(options, "moe_apply_probs_on_input", False) and getattr(options, "moe_router_topk", 1) != 1:
            from mm_adaptor.patches.transformer.moe_grouped_gemm import PROBS_ON_INPUT_REFUSAL

            raise FeatureConfigError(PROBS_ON_INPUT_REFUSAL)
        require_local_spec(self, options)

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer import moe_grouped_gemm as native
        from mm_adaptor.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

        contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
        ps = PatchSet(self.name)
        ps.replace(f"{GROUPED_GEMM_UTIL}.grouped_gemm_is_available", native.grouped_gemm_is_available,
                   contract=contract)
        ps.replace(f"{GROUPED_GEMM_UTIL}.ops", native.NATIVE_GROUPED_GEMM_OPS, contract=contract)
        ps.replace("megatron.core.transformer.moe.experts.GroupedMLP.forward", native.grouped_mlp_forward,
                   contract=contract)
        return [ps]
