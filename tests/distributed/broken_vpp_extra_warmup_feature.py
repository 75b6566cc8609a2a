"""A deliberately wrong --vpp-extra-warmup for the harness's self-test (loaded into the training ranks through
MM_ADAPTOR_FEATURE_MODULES): the extra warm-up forward runs on the last pipeline stage only, so the stages no longer
agree on which transfer carries which micro-batch."""

from mm_adaptor.core.features import BIT_FOR_BIT, Feature, Flag, register


def _extra_on_the_last_stage_only(wrapped, instance, args, kwargs):
    from megatron.core import parallel_state

    total, all_in_warmup, warmup, remaining = wrapped(*args, **kwargs)
    last = (parallel_state.get_pipeline_model_parallel_rank()
            == parallel_state.get_pipeline_model_parallel_world_size() - 1)
    if kwargs.get("forward_only") or all_in_warmup or not last:
        return total, all_in_warmup, warmup, remaining
    return total, warmup + 1 == total, warmup + 1, remaining - 1


@register
class ExtraWarmupOnOneStage(Feature):
    name = "test-broken-vpp-extra-warmup"
    description = "--vpp-extra-warmup on the last pipeline stage only"
    flags = (Flag("--use-test-broken-vpp-extra-warmup", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        from mm_adaptor.core.patching import PatchSet

        ps = PatchSet(self.name)
        ps.wrap("megatron.core.pipeline_parallel.schedules.get_pp_rank_microbatches", _extra_on_the_last_stage_only)
        return [ps]
