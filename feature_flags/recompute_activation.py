"""--recompute-activation-function [--recompute-activation-function-num-layers N]: the MLP's activation keeps its
inputs, not its output; the output's storage is released once fc2 has saved it and refilled by recomputation
just before fc2's backward."""

from mm_adaptor.core.features import Feature, Flag, Tolerance, refuse_unless_local_spec, register
from mm_adaptor.core.verification import (BASE_RELEASE, NO_GPU, ON_0_19_2, PIP_0_18_2, TP2_DISTOPT, fake_npu_check,
                                     same_everywhere)

MAIN = "--recompute-activation-function"
NUM_LAYERS = "--recompute-activation-function-num-layers"


@register
class RecomputeActivation(Feature):
    name = "recompute-activation-function"
    verified_on = {"0.16.1": BASE_RELEASE, "0.18.0": PIP_0_18_2 + " (GPT and HybridModel)", "0.19.0": ON_0_19_2}
    devices = same_everywhere(NO_GPU, fake_npu_check(TP2_DISTOPT))
    refusal_probes = (
        ("N without the main flag", {"recompute_activation_function_num_layers": 1}),
        ("negative N", {"recompute_activation_function": True, "recompute_activation_function_num_layers": -1}),
        ("uniform full recompute", {"recompute_activation_function": True, "recompute_granularity": "full",
                                    "recompute_method": "uniform", "recompute_num_layers": 1}),
        ("moe_act recompute too", {"recompute_activation_function": True, "recompute_granularity": "selective",
                                   "recompute_modules": ["moe_act"]}),
    )
    description = ("the MLP's activation (SwiGLU or GeLU; dense MLP, SequentialMLP and GroupedMLP experts) keeps "
                   "its inputs, not its output: the output's storage is released after fc2 saved it and recomputed "
                   "into the same storage when fc2's output gradient arrives")
    flags = (
        Flag(MAIN, description),
        Flag(NUM_LAYERS, "recompute the activation only in the first N transformer layers of each (virtual) "
                         "pipeline stage (default: all); in a HybridModel the first N of its layers that hold an "
                         "MLP ('-', 'E')", type=int, default=None),
    )
    tolerance = Tolerance(exact=True, why="the recomputed activation is the same computation on the same inputs")

    def is_enabled(self, options) -> bool:
        # N alone counts as asking for the feature, so that validate can refuse it.
        return bool(getattr(options, "recompute_activation_function", False)) or \
            getattr(options, "recompute_activation_function_num_layers", None) is not None

    def validate(self, options):
        refuse_unless_local_spec(self, options, refusal_for(options))

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer import recompute_activation as rc
        from mm_adaptor.patches.transformer.hybrid_stack import HYBRID_STACK, wrap_where_defined
        from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

        n = getattr(options, "recompute_activation_function_num_layers", None)
        contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
        ps = PatchSet(self.name)
        ps.wrap("megatron.core.transformer.transformer_block.TransformerBlock.__init__",
                rc.block_init_marking_layers(n), contract=contract)
        ps.wrap("megatron.core.transformer.mlp.MLP.forward", rc.mlp_forward_recomputing_activation,
                contract=contract)
        # megatron-core 0.18+: a HybridModel's decoder (its '-' and 'E' layers); nothing to patch before
        wrap_where_defined(ps, f"{HYBRID_STACK}.__init__", rc.stack_init_marking_layers(n), contract)
        return [ps]


def refusal_for(options) -> str | None:
    """One line naming the flags that cannot work together, or None."""
    on = bool(getattr(options, "recompute_activation_function", False))
    n = getattr(options, "recompute_activation_function_num_layers", None)
    if n is not None and not on:
        return f"{NUM_LAYERS} needs {MAIN}: add {MAIN} or drop {NUM_LAYERS}"
    if n is not None and n < 0:
        return f"{NUM_LAYERS} {n} is negative: give 0 or more layers (or leave it out for all layers)"
    granularity = getattr(options, "recompute_granularity", None)
    method = getattr(options, "recompute_method", None)
    if granularity == "full" and method == "uniform":
        return (f"{MAIN} has no layer left under --recompute-granularity full --recompute-method uniform (every "
                f"layer is recomputed whole): use --recompute-method block or drop {MAIN}")
    modules = getattr(options, "recompute_modules", None) or []
    if granularity == "selective" and "moe_act" in modules:
        return (f"{MAIN} already recomputes the experts' activation: drop moe_act from --recompute-modules or drop "
                f"{MAIN}")
    return None
