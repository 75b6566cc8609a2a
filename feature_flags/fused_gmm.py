"""--use-fused-gmm: --moe-grouped-gemm runs on the native grouped_matmul, without Transformer Engine or grouped_gemm.

megatron-core 0.16 builds GroupedMLP for --moe-grouped-gemm with the local spec (its grouped_gemm package patched
out); 0.17 removed GroupedMLP and grouped_gemm_util, and the local spec builds SequentialMLP for it (experts one
after the other): there the same flag makes SequentialMLP run every local expert's fc1 and fc2 as one
grouped_matmul each. Each generation's patches are applied where their targets exist.

On the NPU the op runs torch_npu's npu_grouped_matmul forward and backward (ops/grouped_matmul.py), one local expert
per rank a plain matmul; where torch_npu documents no kernel for a call the reference runs, nothing is refused."""

from collections import Counter

from mm_adaptor.core.features import (Feature, FeatureConfigError, Flag, fused_kernel_tolerance, register,
                                      require_local_spec)
from mm_adaptor.core.verification import BASE_RELEASE, EP2_BF16, fake_npu_check, on_one_h100, same_everywhere

GROUPED_GEMM_UTIL = "megatron.core.transformer.moe.grouped_gemm_util"
SEQUENTIAL_MLP_FORWARD = "megatron.core.transformer.moe.experts.SequentialMLP.forward"


@register
class FusedGroupedMatmul(Feature):
    name = "fused-gmm"
    verified_on = {"0.16.1": BASE_RELEASE,
                   "0.19.0": "no GroupedMLP: --moe-grouped-gemm's SequentialMLP runs one grouped_matmul per fc; "
                             "ep2-moe and tp2-sp pass on 0.19.2, a wrong-wgrad variant fails"}
    devices = same_everywhere(on_one_h100("4 experts, --moe-grouped-gemm, fp32, worst 0.29 of the limit"),
                              fake_npu_check(EP2_BF16, "npu_grouped_matmul"))
    refusal_probes = (
        ("probabilities on the input with top-k > 1",
         {"use_fused_gmm": True, "moe_grouped_gemm": True, "num_experts": 4, "disable_bias_linear": True,
          "moe_apply_probs_on_input": True, "moe_router_topk": 2}),
    )
    description = ("--moe-grouped-gemm's experts run mm_adaptor::grouped_matmul (one call per expert group, any "
                   "dtype): megatron-core 0.16's GroupedMLP instead of the grouped_gemm package; 0.17+'s SequentialMLP "
                   "(what the local spec builds there) instead of one GEMM pair per expert; works with expert "
                   "parallelism")
    flags = (Flag("--use-fused-gmm", description),)
    tolerance = fused_kernel_tolerance("per-expert GEMMs on x @ W instead of F.linear(x, W^T) in SequentialMLP")
    # 0.16: GroupedMLP stores all local experts in two matrices; SequentialMLP one Linear pair per expert (0.17+
    # keeps SequentialMLP's layout: starting both runs from one checkpoint changes nothing there).
    changes_parameter_layout = True
    # Megatron-LM asserts compute capability >= 8 for --moe-grouped-gemm (the grouped_gemm package's CUTLASS
    # kernels); the native op has no such limit, so that check runs with the flag hidden.
    megatron_lm_validation_overrides = {"moe_grouped_gemm": False}
    # Unpatched, --moe-grouped-gemm needs the grouped_gemm package (0.16): the baseline is SequentialMLP, the same
    # math (on 0.17+ unpatched --moe-grouped-gemm builds SequentialMLP anyway).
    unpatched_baseline_omits = ("--moe-grouped-gemm",)

    def __init__(self):
        self.grouped = Counter()  # 0.17+: SequentialMLP forwards grouped / left to megatron, GEMMs, in this process

    def statistics(self):
        return dict(self.grouped) or None

    def validate(self, options):
        if not getattr(options, "num_experts", None):
            raise FeatureConfigError("--use-fused-gmm runs MoE experts: add --num-experts (and --moe-grouped-gemm)")
        if not getattr(options, "moe_grouped_gemm", False):
            raise FeatureConfigError("--use-fused-gmm is the kernel behind --moe-grouped-gemm: add --moe-grouped-gemm "
                                     "or drop --use-fused-gmm")
        bias = getattr(options, "add_bias_linear", not getattr(options, "disable_bias_linear", False))
        if bias:
            raise FeatureConfigError("the grouped expert GEMMs take no expert biases (nor did GroupedMLP): add "
                                     "--disable-bias-linear")
        if getattr(options, "moe_apply_probs_on_input", False) and getattr(options, "moe_router_topk", 1) != 1:
            from mm_adaptor.patches.transformer.moe_grouped_gemm import PROBS_ON_INPUT_REFUSAL

            raise FeatureConfigError(PROBS_ON_INPUT_REFUSAL)
        require_local_spec(self, options)

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer import moe_grouped_gemm as native
        from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

        from megatron.core.transformer.moe import experts

        contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
        ps = PatchSet(self.name)
        if hasattr(experts, "GroupedMLP"):  # megatron-core <= 0.16; 0.17 removed it and grouped_gemm_util
            ps.replace(f"{GROUPED_GEMM_UTIL}.grouped_gemm_is_available", native.grouped_gemm_is_available,
                       contract=contract)
            ps.replace(f"{GROUPED_GEMM_UTIL}.ops", native.NATIVE_GROUPED_GEMM_OPS, contract=contract)
            ps.replace("megatron.core.transformer.moe.experts.GroupedMLP.forward", native.grouped_mlp_forward,
                       contract=contract)
        else:  # 0.17+: --moe-grouped-gemm builds SequentialMLP (scripts/fingerprint_megatron.py records this target)
            ps.wrap(SEQUENTIAL_MLP_FORWARD, native.sequential_mlp_forward_grouped(self.grouped), contract=contract)
        return [ps]
