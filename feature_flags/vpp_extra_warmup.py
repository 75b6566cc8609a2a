"""--vpp-extra-warmup [--vpp-extra-warmup-microbatches K]: megatron's interleaved 1F1B schedule with K more
warm-up forwards per stage."""

from mm_adaptor.core.features import Feature, FeatureConfigError, Flag, Tolerance, register
from mm_adaptor.core.verification import BASE_RELEASE, NO_GPU, ON_0_19_2, PP2_VPP, fake_npu_check, same_everywhere

MAIN, COUNT = "--vpp-extra-warmup", "--vpp-extra-warmup-microbatches"
SCHEDULES = "megatron.core.pipeline_parallel.schedules"


@register
class VppExtraWarmup(Feature):
    name = "vpp-extra-warmup"
    verified_on = {"0.16.1": BASE_RELEASE, "0.19.0": ON_0_19_2}
    devices = same_everywhere(NO_GPU, fake_npu_check(PP2_VPP))
    refusal_probes = (
        ("K alone", {"vpp_extra_warmup_microbatches": 2}),
        ("no virtual pipeline", {"vpp_extra_warmup": True, "pipeline_model_parallel_size": 2}),
    )
    description = ("megatron's interleaved 1F1B schedule (a virtual pipeline) runs K more warm-up forwards on every "
                   "stage, so the next forward's input has arrived while the current backward runs; K more "
                   "micro-batches of activations per stage")
    flags = (
        Flag(MAIN, description),
        Flag(COUNT, "extra warm-up micro-batches per stage (default 1; clipped to the micro-batches there are)",
             type=int, default=None),
    )
    tolerance = Tolerance(exact=True, why="the same forward and backward passes; each model chunk's backward "
                                          "passes run in megatron's order, so gradients accumulate in its order")

    def is_enabled(self, options) -> bool:
        return bool(getattr(options, "vpp_extra_warmup", False)) or \
            getattr(options, "vpp_extra_warmup_microbatches", None) is not None

    def validate(self, options):
        refusal = refusal_for(options)
        if refusal:
            raise FeatureConfigError(refusal)

    def statistics(self):
        from mm_adaptor.patches.pipeline.vpp_extra_warmup import IN_FLIGHT

        return {"peak micro-batches in flight": IN_FLIGHT.peak, "schedules extended": IN_FLIGHT.schedules,
                "mean forward ms per chunk": IN_FLIGHT.mean_ms("forward"),
                "mean backward ms per chunk": IN_FLIGHT.mean_ms("backward"),
                "chunk times measured with": IN_FLIGHT.clock,
                "first step's passes": [list(p) for p in IN_FLIGHT.first_step]}

    def patch_sets(self, options):
        from mm_adaptor.patches.pipeline import vpp_extra_warmup as extra
        from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

        contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
        ps = PatchSet(self.name)
        ps.wrap(f"{SCHEDULES}.get_pp_rank_microbatches", extra.warmup_with_extra(extra_count(options)),
                contract=contract)
        ps.wrap(f"{SCHEDULES}.forward_step", extra.counting_forward, contract=contract)
        ps.wrap(f"{SCHEDULES}.backward_step", extra.counting_backward, contract=contract)
        return [ps]


def extra_count(options) -> int:
    k = getattr(options, "vpp_extra_warmup_microbatches", None)
    return 1 if k is None else k


def _virtual_size(options):
    vpp = getattr(options, "virtual_pipeline_model_parallel_size", None)
    if vpp:
        return vpp
    pattern = getattr(options, "hybrid_layer_pattern", None)
    if pattern:  # a HybridModel: '|' separates pipeline segments, more of them than stages are virtual stages
        pp, segments = getattr(options, "pipeline_model_parallel_size", 1) or 1, pattern.split("/")[0].count("|") + 1
        return segments // pp if segments > pp and segments % pp == 0 else None
    per_chunk = getattr(options, "num_layers_per_virtual_pipeline_stage", None)
    pp, layers = getattr(options, "pipeline_model_parallel_size", 1) or 1, getattr(options, "num_layers", None)
    if per_chunk and layers and pp:
        return layers // pp // per_chunk
    return None


def microbatches_per_step(options) -> int | None:
    """Micro-batches per step per data-parallel rank: the built-in driver's num_microbatches, or what Megatron-LM's
    arguments hold (it keeps the count in its micro-batch calculator, not in args); None when not known or not
    fixed (--rampup-batch-size)."""
    given = getattr(options, "num_microbatches", None)
    if given:
        return given
    if getattr(options, "rampup_batch_size", None):
        return None
    global_batch, micro_batch = getattr(options, "global_batch_size", None), getattr(options, "micro_batch_size", None)
    data_parallel = getattr(options, "data_parallel_size", None)
    world = getattr(options, "world_size", None)
    if not data_parallel and world:
        model_parallel = 1
        for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            model_parallel *= getattr(options, dest, None) or 1
        data_parallel = world // model_parallel
    if global_batch and micro_batch and data_parallel:
        return global_batch // (micro_batch * data_parallel) or None
    return None


def refusal_for(options) -> str | None:
    """One line naming the flags that cannot work together, or None."""
    if not getattr(options, "vpp_extra_warmup", False):
        return f"{COUNT} needs {MAIN}: add it or drop {COUNT}"
    k = extra_count(options)
    if k < 1:
        return f"{COUNT} {k}: give 1 or more extra warm-up micro-batches"
    pp, vpp = getattr(options, "pipeline_model_parallel_size", 1) or 1, _virtual_size(options)
    if pp < 2 or not vpp or vpp < 2:
        return (f"{MAIN} extends megatron's interleaved schedule, which needs --pipeline-model-parallel-size 2 or more "
                f"and a virtual pipeline (--num-layers-per-virtual-pipeline-stage giving 2 or more chunks per stage, "
                f"or with --hybrid-layer-pattern 2 or more '|' segments per stage)")
    if getattr(options, "overlap_moe_expert_parallel_comm", False):
        return (f"{MAIN} and --overlap-moe-expert-parallel-comm both add warm-up forwards (that one its own one, with "
                f"its combined 1F1B schedule): keep one")
    microbatches = microbatches_per_step(options)
    if microbatches:
        group = getattr(options, "microbatch_group_size_per_vp_stage", None) or pp
        first_stage_warmup = 2 * (pp - 1) + (vpp - 1) * group
        if microbatches * vpp <= first_stage_warmup:
            return (f"{MAIN}: with {microbatches} micro-batches x {vpp} model chunks every stage already runs all "
                    f"its forwards in megatron's warm-up ({first_stage_warmup} on the first stage), so there is "
                    f"nothing to run earlier: raise --global-batch-size or drop {MAIN}")
    return None
