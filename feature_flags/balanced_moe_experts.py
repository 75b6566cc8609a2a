"""--balanced-moe-experts [--balanced-moe-hot-expert-num N] [--trans-hot-expert-group-num M]
[--balanced-moe-update-interval K]: MindSpeed's flags. The N experts with the most tokens over the EP group are copied
to every EP rank, which computes its own tokens of them; their weight gradients return to the owner
(patches/transformer/balanced_moe_experts.py)."""

from collections import Counter

from mm_adaptor.core.features import Feature, Flag, fused_kernel_tolerance, refuse_unless_local_spec, register
from mm_adaptor.feature_flags.moe_tp_extend_ep import expert_parallel_size, expert_tensor_parallel_size
from mm_adaptor.core.verification import BASE_RELEASE, NO_GPU, ON_0_19_2, TP2_EXTENDED, fake_npu_check, \
    same_everywhere

MAIN = "--balanced-moe-experts"
HOT = "--balanced-moe-hot-expert-num"
GROUPS = "--trans-hot-expert-group-num"
INTERVAL = "--balanced-moe-update-interval"
DEFAULT_HOT = 3  # MindSpeed's default
MOE_LAYER = "megatron.core.transformer.moe.moe_layer.MoELayer"
ALLTOALL = "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher"
FOUR = {"balanced_moe_experts": True, "num_experts": 4, "expert_model_parallel_size": 2}


@register
class BalancedMoEExperts(Feature):
    name = "balanced-moe-experts"
    verified_on = {"0.16.1": BASE_RELEASE, "0.19.0": ON_0_19_2}
    devices = same_everywhere(NO_GPU, fake_npu_check(TP2_EXTENDED))
    refusal_probes = (
        ("a model without experts", {"balanced_moe_experts": True}),
        ("N not below the number of experts", {**FOUR, "balanced_moe_hot_expert_num": 4}),
        ("N below 1", {**FOUR, "balanced_moe_hot_expert_num": 0}),
        ("no expert parallelism", {**FOUR, "expert_model_parallel_size": 1}),
        ("the flex dispatcher", {**FOUR, "moe_token_dispatcher_type": "flex"}),
        ("expert tensor parallelism", {**FOUR, "tensor_model_parallel_size": 2, "sequence_parallel": True}),
        ("several transfer groups", {**FOUR, "trans_hot_expert_group_num": 2}),
        ("an interval beside MoE recompute", {**FOUR, "balanced_moe_update_interval": 2,
                                              "recompute_granularity": "full", "recompute_method": "uniform"}),
        ("token drop and pad", {**FOUR, "moe_expert_capacity_factor": 1.0}),
        ("--moe-zero-memory", {**FOUR, "moe_zero_memory": "level0"}),
        ("tuning flag alone", {"balanced_moe_hot_expert_num": 2, "num_experts": 4}),
    )
    description = ("MoE layers balance their hottest experts: the N experts with the most tokens over the EP group "
                   "(re-chosen every K training forwards of the layer) are broadcast by their owners to every EP "
                   "rank, each rank computes the tokens it routed to them itself (they leave the dispatch), and the "
                   "copies' weight gradients are summed back on the owner")
    flags = (
        Flag(MAIN, description),
        Flag(HOT, f"N: how many hot experts each MoE layer copies (default {DEFAULT_HOT}, MindSpeed's); "
                  "1 <= N < the number of experts", type=int, default=None),
        Flag(GROUPS, "M: MindSpeed's number of communicators the hot experts' broadcasts spread over; one EP group "
                     "carries them here, so only 1 is accepted", type=int, default=None),
        Flag(INTERVAL, "K: re-choose the hot experts every K training forwards of each MoE layer (default 1: every "
                       "micro-batch, from its own counts)", type=int, default=None),
    )
    tolerance = fused_kernel_tolerance(
        "a hot expert's tokens join each token's sum after megatron's combine instead of inside it, and its weight "
        "gradient is the owner's sum of per-rank partial products (fp32) instead of one product: the same math, "
        "another summation order")

    def __init__(self):
        self.counts = Counter()  # in this process: hot experts copied, rows computed locally, gradients returned

    def statistics(self):
        return dict(self.counts) or None

    def is_enabled(self, options) -> bool:
        # a tuning flag alone counts as asking for the feature, so that validate can refuse it
        return bool(getattr(options, "balanced_moe_experts", False)) or any(
            getattr(options, dest, None) is not None for dest in
            ("balanced_moe_hot_expert_num", "trans_hot_expert_group_num", "balanced_moe_update_interval"))

    def validate(self, options):
        refuse_unless_local_spec(self, options, refusal_for(options))

    def patch_sets(self, options):
        return balanced_patch_sets(self.name, hot_num(options), interval(options), self.counts)


def hot_num(options) -> int:
    n = getattr(options, "balanced_moe_hot_expert_num", None)
    return DEFAULT_HOT if n is None else n


def interval(options) -> int:
    k = getattr(options, "balanced_moe_update_interval", None)
    return 1 if k is None else k


def balanced_patch_sets(name, n, k, counts, copy_class=None):
    """copy_class: the hot experts' transfer (patches' HotExpertCopy unless given: the broken variant's test)."""
    from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet
    from mm_adaptor.patches.transformer import balanced_moe_experts as bm

    contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
    ps = PatchSet(name)
    ps.wrap(f"{MOE_LAYER}.preprocess",
            bm.preprocess_balancing(n, k, counts, copy_class or bm.HotExpertCopy),
            contract=contract)
    ps.wrap(f"{MOE_LAYER}.postprocess", bm.postprocess_adding_hot_output, contract=contract)
    ps.wrap(f"{ALLTOALL}.preprocess", bm.alltoall_preprocess_counting_rows, contract=contract)
    return [ps]


def refusal_for(options) -> str | None:
    """One line naming the flags that cannot work together, or None."""
    if not getattr(options, "balanced_moe_experts", False):
        given = [flag for flag, dest in ((HOT, "balanced_moe_hot_expert_num"), (GROUPS, "trans_hot_expert_group_num"),
                                         (INTERVAL, "balanced_moe_update_interval"))
                 if getattr(options, dest, None) is not None]
        return f"{' and '.join(given)} tune {MAIN}: add {MAIN} or drop {' and '.join(given)}"
    experts = getattr(options, "num_experts", None)
    if not experts:
        return f"{MAIN} balances MoE layers and the model has none: add --num-experts or drop {MAIN}"
    n = hot_num(options)
    if n < 1 or n >= experts:
        return (f"{HOT} {n} is outside 1 .. {experts - 1} (--num-experts {experts}): give at least 1 hot expert and "
                f"fewer than all of them")
    k = interval(options)
    if k < 1:
        return f"{INTERVAL} {k}: give 1 or more training forwards between choices"
    m = getattr(options, "trans_hot_expert_group_num", None)
    if m is not None and m != 1:
        return (f"{GROUPS} {m}: the hot experts' broadcasts go over the one EP group here, not over {m} "
                f"communicators: give {GROUPS} 1 or drop it")
    if expert_parallel_size(options) < 2:
        return (f"{MAIN} moves hot experts between expert-parallel ranks, and --expert-model-parallel-size 1 holds "
                f"every expert on each rank: give --expert-model-parallel-size 2 or more, or drop {MAIN}")
    dispatcher = getattr(options, "moe_token_dispatcher_type", "allgather")
    if dispatcher not in ("allgather", "alltoall"):
        return (f"{MAIN} takes the hot experts' tokens out of the routing map megatron's allgather and alltoall "
                f"dispatchers read, not {dispatcher}'s: use --moe-token-dispatcher-type alltoall or drop {MAIN}")
    etp = expert_tensor_parallel_size(options)
    if etp > 1:
        return (f"{MAIN} copies whole experts, and expert tensor parallelism {etp} slices them: give "
                f"--expert-tensor-parallel-size 1 (or --moe-tp-extend-ep) or drop {MAIN}")
    if getattr(options, "moe_grouped_gemm", False):
        from megatron.core.transformer.moe import experts as megatron_experts

        if hasattr(megatron_experts, "GroupedMLP"):  # megatron-core 0.16: one stacked matrix for all local experts
            fused = " (--use-fused-gmm)" if getattr(options, "use_fused_gmm", False) else ""
            return (f"{MAIN} computes a hot expert with megatron's per-expert MLP, and on this megatron-core "
                    f"--moe-grouped-gemm{fused} builds GroupedMLP (all local experts in one matrix): drop "
                    f"--moe-grouped-gemm{' and --use-fused-gmm' if fused else ''} or drop {MAIN}")
    if getattr(options, "moe_expert_capacity_factor", None) is not None or \
            getattr(options, "moe_pad_expert_input_to_capacity", False):
        return (f"{MAIN} is dropless only: a capacity would be counted without the hot experts' tokens; drop "
                f"--moe-expert-capacity-factor (and --moe-pad-expert-input-to-capacity) or drop {MAIN}")
    granularity = getattr(options, "recompute_granularity", None)
    modules = getattr(options, "recompute_modules", None) or []
    if k > 1 and (granularity == "full" or (granularity == "selective" and "moe" in modules)):
        return (f"{INTERVAL} {k} counts forwards, and a recomputed MoE layer runs its forward again in backward, "
                f"where it must take the hot experts it took the first time: drop {INTERVAL} or the recompute")
    for switch, why in (("moe_zero_memory", "dispatches the experts' input again from the routing map this feature "
                                            "changes"),
                        ("moe_alltoall_overlap_comm", "splits the dispatch by local experts and wraps the same steps"),
                        ("overlap_moe_expert_parallel_comm", "splits the layer's forward across micro-batches"),
                        ("moe_latent_size", "dispatches a projection of the layer's input"),
                        ("delay_wgrad_compute", "defers the experts' weight gradients past the copies' reduce"),
                        ("overlap_dispatch_backward_with_experts_wgrad", "defers the experts' weight gradients")):
        value = getattr(options, switch, None)
        if value and value != "disable":
            flag = "--" + switch.replace("_", "-")
            return f"{flag} {why}: drop {flag} or drop {MAIN}"
    return None
