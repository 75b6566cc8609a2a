"""--moe-alltoall-overlap-comm [--moe-alltoall-overlap-chunks N]: MindSpeed's flag. Under megatron's alltoall token
dispatcher, dispatch and combine go by chunks of local experts, each chunk's all-to-all in flight while other chunks'
experts (and the shared experts) compute, forward and backward (patches/transformer/moe_alltoall_overlap.py)."""

from collections import Counter

from mm_adaptor.core.features import Feature, Flag, Tolerance, refuse_unless_local_spec, register
from mm_adaptor.feature_flags.moe_tp_extend_ep import expert_parallel_size, expert_tensor_parallel_size
from mm_adaptor.core.verification import BASE_RELEASE, NO_GPU, ON_0_19_2, EP2_OVERLAP, fake_npu_check, \
    same_everywhere

MAIN = "--moe-alltoall-overlap-comm"
CHUNKS = "--moe-alltoall-overlap-chunks"
MOE_LAYER = "megatron.core.transformer.moe.moe_layer.MoELayer"
A2A = "--moe-token-dispatcher-type alltoall"


@register
class MoEAlltoAllOverlap(Feature):
    name = "moe-alltoall-overlap-comm"
    verified_on = {"0.16.1": BASE_RELEASE, "0.19.0": ON_0_19_2}
    devices = same_everywhere("gloo's background thread is the only concurrency it ran with; " + NO_GPU,
                              fake_npu_check(EP2_OVERLAP))
    refusal_probes = (
        ("the chunk count alone", {"moe_alltoall_overlap_chunks": 2, "num_experts": 4}),
        ("a model without experts", {"moe_alltoall_overlap_comm": True}),
        ("the allgather dispatcher", {"moe_alltoall_overlap_comm": True, "num_experts": 4,
                                      "expert_model_parallel_size": 2}),
        ("more chunks than local experts", {"moe_alltoall_overlap_comm": True, "num_experts": 4,
                                            "expert_model_parallel_size": 2, "moe_token_dispatcher_type": "alltoall",
                                            "moe_alltoall_overlap_chunks": 4}),
        ("grouped GEMMs", {"moe_alltoall_overlap_comm": True, "num_experts": 4, "expert_model_parallel_size": 2,
                           "moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": True}),
        ("--moe-zero-memory", {"moe_alltoall_overlap_comm": True, "num_experts": 4, "expert_model_parallel_size": 2,
                               "moe_token_dispatcher_type": "alltoall", "moe_zero_memory": "level0"}),
    )
    description = ("megatron's alltoall dispatcher by chunks of local experts: every chunk's dispatch all-to-all "
                   "(tokens, probabilities) is issued asynchronously at once, the shared experts compute while they "
                   "fly, each chunk's experts compute as soon as its rows arrive and its combine all-to-all is "
                   "issued asynchronously before the next chunk computes; backward issues each reverse all-to-all "
                   "asynchronously the same way")
    flags = (
        Flag(MAIN, description),
        Flag(CHUNKS, "chunks of local experts (default: one per local expert; at most the local experts)", type=int,
             default=None),
    )
    tolerance = Tolerance(exact=True, why=(
        "the same rows reach the same experts in the same order (SequentialMLP computes expert by expert), every "
        "reorder is a row copy, and the layer input's gradient is summed in megatron's order"))

    def __init__(self):
        self.counts = Counter()  # chunks sent async, overlapped expert chunks: in this process

    def statistics(self):
        return dict(self.counts) or None

    def is_enabled(self, options) -> bool:
        return bool(getattr(options, "moe_alltoall_overlap_comm", False)) or \
            getattr(options, "moe_alltoall_overlap_chunks", None) is not None

    def validate(self, options):
        refuse_unless_local_spec(self, options, refusal_for(options))

    def patch_sets(self, options):
        return overlap_patch_sets(self.name, chunks_of(options), self.counts)


def local_experts(options) -> int:
    return (getattr(options, "num_experts", None) or 0) // max(expert_parallel_size(options), 1)


def chunks_of(options) -> int:
    n = getattr(options, "moe_alltoall_overlap_chunks", None)
    return n if n is not None else max(local_experts(options), 1)


def overlap_patch_sets(name, chunks, counts, expert_for=None):
    from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet
    from mm_adaptor.patches.transformer import moe_alltoall_overlap as ao

    overlap = ao.Overlap(chunks, counts, expert_for)
    contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
    ps = PatchSet(name)
    for step in ao.STEPS:
        ps.wrap(f"{MOE_LAYER}.{step}", ao.method_wrapper(overlap, step), contract=contract)
    return [ps]


def refusal_for(options) -> str | None:
    """One line naming the flags that cannot work together, or None."""
    on = bool(getattr(options, "moe_alltoall_overlap_comm", False))
    n = getattr(options, "moe_alltoall_overlap_chunks", None)
    if not on:
        return f"{CHUNKS} says how many chunks {MAIN} uses: add {MAIN} or drop {CHUNKS}"
    if not getattr(options, "num_experts", None):
        return f"{MAIN} overlaps MoE layers' all-to-alls and the model has none: add --num-experts or drop {MAIN}"
    dispatcher = getattr(options, "moe_token_dispatcher_type", "allgather")
    if dispatcher != "alltoall":
        return (f"{MAIN} chunks the all-to-alls of megatron's alltoall dispatcher, and --moe-token-dispatcher-type "
                f"{dispatcher} has none: use {A2A} or drop {MAIN}")
    if expert_parallel_size(options) < 2:
        return (f"{MAIN} overlaps expert-parallel all-to-alls, and --expert-model-parallel-size 1 has none: use "
                f"--expert-model-parallel-size 2 or more, or drop {MAIN}")
    experts = local_experts(options)
    if n is not None and not 1 <= n <= experts:
        return (f"{CHUNKS} {n}: a chunk is a group of local experts and each rank has {experts}: give 1 to {experts} "
                f"or drop {CHUNKS}")
    if getattr(options, "moe_grouped_gemm", False):
        grouped = "--use-fused-gmm (with --moe-grouped-gemm)" if getattr(options, "use_fused_gmm", False) else \
            "--moe-grouped-gemm"
        return (f"{MAIN} computes each chunk's experts one by one (SequentialMLP) so that each expert sees exactly "
                f"megatron's rows, and {grouped} runs every local expert in one grouped GEMM: drop one")
    if getattr(options, "moe_pad_expert_input_to_capacity", False):
        return (f"{MAIN} chunks dropless rows, and --moe-pad-expert-input-to-capacity pads every expert to its "
                f"capacity: drop one")
    if getattr(options, "moe_apply_probs_on_input", False):
        return (f"--moe-apply-probs-on-input scales the experts' input inside SequentialMLP, which {MAIN} "
                f"bypasses: drop one")
    if getattr(options, "moe_zero_memory", "disable") not in (None, "disable"):
        return ("--moe-zero-memory dispatches the experts' input again in backward through megatron's one "
                f"all-to-all, which {MAIN} replaces by chunks: drop one")
    if getattr(options, "use_coc", False) or getattr(options, "use_ascend_coc", False):
        if expert_tensor_parallel_size(options) > 1:
            return (f"--use-coc gathers tensor-parallel experts' rows itself in routed_experts_compute, which {MAIN} "
                    f"replaces: drop one, or give --expert-tensor-parallel-size 1")
    for switch, why in (("moe_shared_expert_overlap", f"overlaps the shared experts with megatron's one dispatch, "
                                                      f"and {MAIN} computes them while its chunks fly"),
                        ("overlap_moe_expert_parallel_comm", "overlaps one micro-batch's all-to-alls with another's "
                                                             "computation through megatron's own schedule"),
                        ("overlap_dispatch_backward_with_experts_wgrad", "hooks megatron's one dispatch for its "
                                                                         "delayed weight gradient"),
                        ("moe_latent_size", "dispatches a projection of the layer's input")):
        if getattr(options, switch, None):
            flag = "--" + switch.replace("_", "-")
            return f"{flag} {why}: drop {flag} or drop {MAIN}"
    return None
