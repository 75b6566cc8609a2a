"""--swap-attention [--swap-modules ...] [--swap-prefetch-distance D] [--swap-min-bytes N] [--swap-select S]: what
the attention block saves for backward waits in host memory between a layer's forward and its backward, in the layers
whose copies the host link can hide (all of them with --swap-select all)."""

from mm_adaptor.feature_flags._refusals import cuda_graph_refusal
from mm_adaptor.core.features import Feature, Flag, Tolerance, refuse_unless_local_spec, register
from mm_adaptor.core.verification import (BASE_RELEASE, ON_0_19_2, PIP_0_17_1, PIP_0_18_2, TP2_DISTOPT, fake_npu_check,
                                     changed_since_h100, same_everywhere)

MAIN = "--swap-attention"
MODULES = "--swap-modules"
DISTANCE = "--swap-prefetch-distance"
MIN_BYTES = "--swap-min-bytes"
SELECT = "--swap-select"
DEFAULT_MIN_BYTES = 64 * 1024
SELECT_MODES = ("bandwidth", "all")  # the patch module's, kept here so that parsing imports no torch
DEFAULT_SELECT = "bandwidth"
TUNING = ((MODULES, "swap_modules"), (DISTANCE, "swap_prefetch_distance"), (MIN_BYTES, "swap_min_bytes"),
          (SELECT, "swap_select"))


@register
class SwapAttention(Feature):
    name = "swap-attention"
    verified_on = {"0.16.1": BASE_RELEASE, "0.17.1": PIP_0_17_1, "0.18.0": PIP_0_18_2 + " (GPT and HybridModel)",
                   "0.19.0": ON_0_19_2}
    devices = same_everywhere(changed_since_h100(
        "check --layout single passed with every layer swapped (today's --swap-select all), fp32, --swap-min-bytes 0, "
        "saved activations -43% and -46% on device",
        "issue 53: the default --swap-select bandwidth times layers and copies with device events",
        compiled=False),
                              fake_npu_check(TP2_DISTOPT + " (the fake's streams are synchronous)"))
    refusal_probes = (
        ("tuning flag alone", {"swap_min_bytes": 0}),
        ("unknown module", {"swap_attention": True, "swap_modules": "attention"}),
        ("negative distance", {"swap_attention": True, "swap_prefetch_distance": -1}),
        ("unknown selection", {"swap_attention": True, "swap_select": "fastest"}),
        ("uniform full recompute", {"swap_attention": True, "recompute_granularity": "full",
                                    "recompute_method": "uniform"}),
        ("with megatron's --cpu-offloading", {"swap_attention": True, "cpu_offloading": True}),
        ("with a CUDA graph", {"swap_attention": True, "enable_cuda_graph": True}),
    )
    description = ("tensors the attention block (input norm, self-attention, post-attention norm) saves for backward "
                   "are copied to pinned host memory on a side stream during forward and their device storage let "
                   "go; each layer is copied back on another side stream when the layer D above it starts its "
                   "backward; by default the last layer of each model chunk stays on the device and the other "
                   "layers swap only where the measured link hides their copy (--swap-select)")
    flags = (
        Flag(MAIN, description),
        Flag(MODULES, "comma-separated TransformerLayer children to swap (default: input_layernorm,self_attention,"
                      "pre_mlp_layernorm; also cross_attention, pre_cross_attn_layernorm, mlp; MindSpeed's "
                      "input_norm and post_attention_norm are accepted)", type=str, default=None),
        Flag(DISTANCE, "bring layer L back when layer L + D starts its backward (default 1; 0: when L's own "
                       "backward starts)", type=int, default=None),
        Flag(MIN_BYTES, f"swap only storages of at least this many bytes (default {DEFAULT_MIN_BYTES}: below it a "
                        "copy's fixed cost outweighs what it frees)", type=int, default=None),
        Flag(SELECT, "which layers swap: bandwidth (default: never the last layer of a model chunk; the others "
                     "only if, at the host link's rate timed in the first two passes, their copy out ends within the "
                     "next layer's forward) or all (every layer, the last included: the behaviour before the rule, "
                     "for tests and for measuring it)", type=str, default=None, choices=SELECT_MODES),
    )
    tolerance = Tolerance(exact=True, why="a copy to host memory and back returns the same bits")

    def is_enabled(self, options) -> bool:
        # a tuning flag alone counts as asking for the feature, so that validate can refuse it
        return bool(getattr(options, "swap_attention", False)) or any(
            getattr(options, dest, None) is not None for _flag, dest in TUNING)

    def validate(self, options):
        refuse_unless_local_spec(self, options, refusal_for(options))

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer import swap_attention as sa

        self.manager = sa.SwapManager(**manager_options(options))
        return [patch_set(self.name, self.manager)]

    def statistics(self):
        manager = getattr(self, "manager", None)
        return manager.statistics() if manager is not None else None


def manager_options(options) -> dict:
    from mm_adaptor.patches.transformer.swap_attention import module_names

    distance = getattr(options, "swap_prefetch_distance", None)
    min_bytes = getattr(options, "swap_min_bytes", None)
    return dict(modules=module_names(getattr(options, "swap_modules", None)),
                prefetch_distance=1 if distance is None else distance,
                min_bytes=DEFAULT_MIN_BYTES if min_bytes is None else min_bytes,
                select=getattr(options, "swap_select", None) or DEFAULT_SELECT)


def patch_set(name: str, manager):
    """The wraps that make `manager` swap: block passes, layer passes, which layers take part (for megatron's
    TransformerBlock, and on megatron-core 0.18+ for a HybridModel's HybridStack)."""
    from mm_adaptor.patches.transformer import swap_attention as sa
    from mm_adaptor.patches.transformer.hybrid_stack import HYBRID_STACK, wrap_where_defined
    from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

    contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
    ps = PatchSet(name)
    ps.wrap("megatron.core.transformer.transformer_block.TransformerBlock.__init__", sa.block_init_marking_layers,
            contract=contract)
    ps.wrap("megatron.core.transformer.transformer_block.TransformerBlock.forward", manager.block_forward,
            contract=contract)
    ps.wrap("megatron.core.transformer.transformer_layer.TransformerLayer.forward", manager.layer_forward,
            contract=contract)
    wrap_where_defined(ps, f"{HYBRID_STACK}.__init__", sa.block_init_marking_layers, contract)
    wrap_where_defined(ps, f"{HYBRID_STACK}.forward", manager.block_forward, contract)
    return ps


def refusal_for(options) -> str | None:
    """One line naming the flags that cannot work together, or None."""
    from mm_adaptor.patches.transformer.swap_attention import KNOWN_MODULES, module_names

    on = bool(getattr(options, "swap_attention", False))
    given = [flag for flag, dest in TUNING if getattr(options, dest, None) is not None]
    if given and not on:
        return f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} {MAIN}: add {MAIN} or drop them"
    modules = getattr(options, "swap_modules", None)
    if modules is not None:
        try:
            if not module_names(modules):
                return f"{MODULES} names no module: give one or more of {','.join(KNOWN_MODULES)}"
        except KeyError as unknown:
            return (f"{MODULES}: {unknown.args[0]!r} is not a transformer layer module; choose from "
                    f"{','.join(KNOWN_MODULES)} (or MindSpeed's input_norm, post_attention_norm)")
    select = getattr(options, "swap_select", None)
    if select is not None and select not in SELECT_MODES:
        return f"{SELECT} {select!r}: choose {' or '.join(SELECT_MODES)}"
    for flag, dest in ((DISTANCE, "swap_prefetch_distance"), (MIN_BYTES, "swap_min_bytes")):
        value = getattr(options, dest, None)
        if value is not None and value < 0:
            return f"{flag} {value} is negative: give 0 or more"
    if getattr(options, "recompute_granularity", None) == "full" and \
            getattr(options, "recompute_method", None) == "uniform":
        return (f"{MAIN} has no layer left under --recompute-granularity full --recompute-method uniform (every "
                f"layer is recomputed whole, keeping nothing to swap): use --recompute-method block or drop {MAIN}")
    for megatron_flag, dest in (("--cpu-offloading", "cpu_offloading"),
                                ("--fine-grained-activation-offloading", "fine_grained_activation_offloading")):
        if getattr(options, dest, False):
            return (f"{MAIN} and megatron's {megatron_flag} would both move the same activations to host memory: "
                    f"keep one")
    return cuda_graph_refusal(MAIN, options)
