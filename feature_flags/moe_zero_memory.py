"""--moe-zero-memory level0|level1 [--moe-zero-memory-num-layers N]: MindSpeed's flag. MoE layers keep less for the
backward and get it back by dispatching and computing again (patches/transformer/moe_zero_memory.py)."""

from collections import Counter

from mm_adaptor.core.features import Feature, Flag, Tolerance, refuse_unless_local_spec, register
from mm_adaptor.core.verification import BASE_RELEASE, EP2_BF16, NO_GPU, ON_0_19_2, fake_npu_check, same_everywhere

MAIN = "--moe-zero-memory"
NUM_LAYERS = "--moe-zero-memory-num-layers"
LEVELS = ("disable", "level0", "level1")
MOE_LAYER = "megatron.core.transformer.moe.moe_layer.MoELayer"


@register
class MoEZeroMemory(Feature):
    name = "moe-zero-memory"
    verified_on = {"0.16.1": BASE_RELEASE, "0.19.0": ON_0_19_2}
    devices = same_everywhere(NO_GPU, fake_npu_check(EP2_BF16 + ", level0 beside --use-fused-gmm"))
    refusal_probes = (
        ("N without level1", {"moe_zero_memory": "level0", "moe_zero_memory_num_layers": 1, "num_experts": 4}),
        ("a model without experts", {"moe_zero_memory": "level0"}),
        ("the flex dispatcher", {"moe_zero_memory": "level0", "num_experts": 4, "moe_token_dispatcher_type": "flex"}),
        ("level1 with grouped GEMMs", {"moe_zero_memory": "level1", "num_experts": 4, "moe_grouped_gemm": True}),
        ("megatron's moe recompute too", {"moe_zero_memory": "level0", "num_experts": 4,
                                          "recompute_granularity": "selective", "recompute_modules": ["moe"]}),
    )
    description = ("MoE layers keep less for the backward. level0: the experts' input is not kept (the backward "
                   "dispatches the layer's input again, megatron's own dispatcher with this micro-batch's state) and "
                   "the routed and shared experts' activations are recomputed; level1: each expert's fc1 output is "
                   "not kept either (fc1 and the activation recomputed together)")
    flags = (
        Flag(MAIN, description, type=str, default="disable", choices=LEVELS),
        Flag(NUM_LAYERS, "level1 only in the first N MoE layers of each (virtual) pipeline stage, level0 in the "
                         "others (default: level1 in all)", type=int, default=None),
    )
    tolerance = Tolerance(exact=True, why="the same dispatch and the same computation on the same inputs")

    def __init__(self):
        self.counts = Counter()  # inputs released, dispatched again: in this process

    def statistics(self):
        return dict(self.counts) or None

    def is_enabled(self, options) -> bool:
        # N alone counts as asking for the feature, so that validate can refuse it.
        return getattr(options, "moe_zero_memory", "disable") not in (None, "disable") or \
            getattr(options, "moe_zero_memory_num_layers", None) is not None

    def validate(self, options):
        refuse_unless_local_spec(self, options, refusal_for(options))

    def patch_sets(self, options):
        return zero_memory_patch_sets(self.name, options.moe_zero_memory,
                                      getattr(options, "moe_zero_memory_num_layers", None), self.counts,
                                      wrap_mlp=not getattr(options, "recompute_activation_function", False))


def zero_memory_patch_sets(name, level, level1_layers, counts, *, wrap_mlp=True, redispatch_class=None):
    """wrap_mlp: False where --recompute-activation-function wraps MLP.forward already (the same wrapper)."""
    from mm_adaptor.patches.transformer import moe_zero_memory as zm
    from mm_adaptor.patches.transformer import recompute_activation as rc
    from mm_adaptor.patches.transformer.hybrid_stack import HYBRID_STACK, wrap_where_defined
    from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

    contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
    ps = PatchSet(name)
    marking = zm.block_init_marking(level, level1_layers)
    ps.wrap("megatron.core.transformer.transformer_block.TransformerBlock.__init__", marking, contract=contract)
    wrap_where_defined(ps, f"{HYBRID_STACK}.__init__", marking, contract)
    ps.wrap(f"{MOE_LAYER}.preprocess", zm.preprocess_noting_route(counts, redispatch_class), contract=contract)
    ps.wrap(f"{MOE_LAYER}.routed_experts_compute", zm.routed_experts_compute_releasing_input(counts),
            contract=contract)
    if wrap_mlp:
        ps.wrap("megatron.core.transformer.mlp.MLP.forward", rc.mlp_forward_recomputing_activation,
                contract=contract)
    return [ps]


def refusal_for(options) -> str | None:
    """One line naming the flags that cannot work together, or None."""
    level = getattr(options, "moe_zero_memory", "disable")
    n = getattr(options, "moe_zero_memory_num_layers", None)
    if n is not None and level != "level1":
        return f"{NUM_LAYERS} says how many MoE layers take level1: give {MAIN} level1 or drop {NUM_LAYERS}"
    if n is not None and n < 0:
        return f"{NUM_LAYERS} {n} is negative: give 0 or more layers (or leave it out for all layers)"
    if not getattr(options, "num_experts", None):
        return f"{MAIN} acts on MoE layers and the model has none: add --num-experts or drop {MAIN}"
    dispatcher = getattr(options, "moe_token_dispatcher_type", "allgather")
    if dispatcher not in ("allgather", "alltoall"):
        return (f"{MAIN} dispatches the experts' input again through megatron's dispatcher, which it does for "
                f"allgather and alltoall, not {dispatcher}: use --moe-token-dispatcher-type alltoall or drop {MAIN}")
    if level == "level1" and getattr(options, "moe_grouped_gemm", False):
        fused = getattr(options, "use_fused_gmm", False)
        return (f"{MAIN} level1 recomputes each expert's fc1 through megatron's MLP, and --moe-grouped-gemm"
                f"{' (--use-fused-gmm)' if fused else ''} computes every expert's fc1 at once: use {MAIN} level0 or "
                f"drop --moe-grouped-gemm{' and --use-fused-gmm' if fused else ''}")
    expert_tp = (getattr(options, "expert_tensor_parallel_size", None)
                 or getattr(options, "tensor_model_parallel_size", 1))
    if getattr(options, "use_coc", False) and expert_tp > 1:
        return (f"--use-coc runs tensor-parallel experts on tokens of its own, not the dispatched input {MAIN} "
                f"releases: drop one, or give --expert-tensor-parallel-size 1")
    granularity = getattr(options, "recompute_granularity", None)
    if granularity == "full" and getattr(options, "recompute_method", None) == "uniform":
        return (f"{MAIN} has no layer left under --recompute-granularity full --recompute-method uniform (every "
                f"layer is recomputed whole): use --recompute-method block or drop {MAIN}")
    modules = getattr(options, "recompute_modules", None) or []
    recomputed = [m for m in ("moe", "moe_act") if m in modules]
    if granularity == "selective" and recomputed:
        return (f"--recompute-modules {' '.join(recomputed)} already recomputes what {MAIN} releases: drop "
                f"{' and '.join(recomputed)} from --recompute-modules or drop {MAIN}")
    for switch, why in (("moe_shared_expert_overlap", "computes the shared experts inside the dispatch, which "
                                                      "would run them again"),
                        ("overlap_moe_expert_parallel_comm", "splits the layer's dispatch across micro-batches"),
                        ("overlap_dispatch_backward_with_experts_wgrad", "hooks the experts' input for its delayed "
                                                                         "weight gradient"),
                        ("moe_latent_size", "dispatches a projection of the layer's input")):
        if getattr(options, switch, None):
            flag = "--" + switch.replace("_", "-")
            return f"{flag} {why}: drop {flag} or drop {MAIN}"
    return None
