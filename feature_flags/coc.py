"""--use-coc [--coc-parallel-num N] (alias --use-ascend-coc): tensor-parallel collectives run chunk by chunk,
overlapped with the matmuls of the other chunks."""

from collections import Counter

from mm_adaptor.core.features import Feature, Flag, Tolerance, refuse_unless_local_spec, register
from mm_adaptor.core.verification import (BASE_RELEASE, NO_GPU, PIP_0_17_1, PIP_0_18_2, TP2_DISTOPT, fake_npu_check,
                                     same_everywhere)

MAIN, ALIAS, CHUNKS = "--use-coc", "--use-ascend-coc", "--coc-parallel-num"
CHUNK_CHOICES = (1, 2, 4, 8)

LINEAR = "megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce"
ROW_FORWARD = "megatron.core.tensor_parallel.layers.RowParallelLinear.forward"
COLUMN_FORWARD = "megatron.core.tensor_parallel.layers.ColumnParallelLinear.forward"
ROUTED_EXPERTS = "megatron.core.transformer.moe.moe_layer.MoELayer.routed_experts_compute"


@register
class ComputeOverlappedCommunication(Feature):
    name = "coc"
    verified_on = {"0.16.1": BASE_RELEASE, "0.17.1": PIP_0_17_1, "0.18.0": PIP_0_18_2,
                   "0.19.0": "linears bound by the installed signature; GTP, delayed wgrad and zero-copy experts "
                             "left to megatron; bit for bit in every TP layout on 0.19.2"}
    devices = same_everywhere("NCCL overlap " + NO_GPU + " (needs two GPUs)", fake_npu_check(TP2_DISTOPT))
    refusal_probes = (
        ("tuning flag alone", {"coc_parallel_num": 2}),
        ("no tensor parallelism", {"use_coc": True, "tensor_model_parallel_size": 1}),
        ("with --tp-comm-overlap", {"use_coc": True, "tensor_model_parallel_size": 2, "tp_comm_overlap": True}),
    )
    description = ("tensor-parallel linears split each rank's sequence rows into N chunks: a column-parallel "
                   "linear under sequence parallelism multiplies chunk i while the all-gathers of the later chunks "
                   "are in flight; a row-parallel linear starts each chunk's reduce-scatter (or all-reduce) as soon "
                   "as its product is computed; backward mirrors both, the weight gradient (one GEMM, as megatron) "
                   "overlapping the last reduce-scatters")
    flags = (
        Flag(MAIN, description),
        Flag(ALIAS, f"the same as {MAIN} (MindSpeed's name for it)"),
        Flag(CHUNKS, "chunks per tensor-parallel linear (default 4; uneven when the rows do not divide, 1 = "
                     "megatron's own path)", type=int, default=None, choices=CHUNK_CHOICES),
    )
    tolerance = Tolerance(exact=False, why=(
        "every output row is the same product of the same operands and the weight gradient one GEMM over the same "
        "rows in the same order, but a GEMM over fewer rows may round its last rows differently (another kernel "
        "for an M-tail: on this CPU's GEMM, chunks of other than a multiple of 4 rows), and a reduction over more "
        "than two ranks may be summed in another order for a smaller tensor; measured bit-for-bit in every tested "
        "dense layout"))

    def __init__(self):
        self.chunked_calls = Counter()  # forward calls that went by chunks, per kind of linear, in this process

    def is_enabled(self, options) -> bool:
        # the chunk count alone counts as asking, so that validate can refuse it
        return any(getattr(options, dest, None) for dest in ("use_coc", "use_ascend_coc", "coc_parallel_num"))

    def validate(self, options):
        refuse_unless_local_spec(self, options, refusal_for(options))

    def statistics(self):
        return {f"chunked {kind} calls": n for kind, n in sorted(self.chunked_calls.items())} or None

    def patch_sets(self, options):
        from mm_adaptor.patches.tensor_parallel import coc
        from mm_adaptor.patches.transformer import coc_experts
        from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

        linears = coc.ChunkedLinears(chunks_of(options), calls=self.chunked_calls)
        contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
        ps = PatchSet(self.name)
        ps.wrap(LINEAR, linears.linear_under_sequence_parallel, contract=contract)
        ps.wrap(ROW_FORWARD, linears.row_parallel_forward, contract=contract)
        ps.wrap(COLUMN_FORWARD, linears.column_parallel_expert_forward, contract=contract)
        ps.wrap(ROUTED_EXPERTS, coc_experts.routed_experts_compute_chunked(linears), contract=contract)
        return [ps]


def chunks_of(options) -> int:
    n = getattr(options, "coc_parallel_num", None)
    return 4 if n is None else n


def refusal_for(options) -> str | None:
    """One line naming the flags that cannot work together, or None."""
    on = bool(getattr(options, "use_coc", False) or getattr(options, "use_ascend_coc", False))
    if not on:
        return f"{CHUNKS} needs {MAIN} (or {ALIAS}): add it or drop {CHUNKS}"
    tp = getattr(options, "tensor_model_parallel_size", 1) or 1
    if tp == 1:
        return (f"{MAIN} overlaps tensor-parallel communication, and --tensor-model-parallel-size 1 has none: "
                f"use --tensor-model-parallel-size 2 or more, or drop {MAIN}")
    if getattr(options, "lora_target_modules", None):
        return (f"{MAIN} chunks the linears' trainable path (megatron's linear_with_grad_accumulation_and_async_"
                "allreduce), and LoRA (--lora-target-modules) freezes their weights, which megatron then runs through "
                f"linear_with_frozen_weight, unchunked: keep one")
    if getattr(options, "tp_comm_overlap", False):
        return (f"{MAIN} and --tp-comm-overlap both overlap the tensor-parallel collectives (this one by chunks, "
                f"that one through Transformer Engine's userbuffers): keep one")
    return None
