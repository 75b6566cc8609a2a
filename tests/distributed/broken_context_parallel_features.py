"""Deliberately wrong context parallelism for the harness's self-test (loaded into the training ranks through
MM_ADAPTOR_FEATURE_MODULES), each beside the real --context-parallel-size 2: a ring that forgets the causal mask of
its diagonal blocks (each token also sees the later tokens of its own chunk), a ring whose softmax scale is 0.1%
too large (a subtle forward error), Ulysses that gathers the heads in the wrong order, and packed attention that
crosses the samples of a pack."""

from mm_adaptor.core.features import Feature, Flag, register


def _wrong(scale_factor: float = 1.0, **broken):
    def wrapper(wrapped, instance, args, kwargs):
        if scale_factor != 1.0:
            broken["scale"] = kwargs["scale"] * scale_factor
        return wrapped(*args, **{**kwargs, **broken})
    return wrapper


class _BrokenContextParallel(Feature):
    broken: dict = {}

    def patch_sets(self, options):
        from mm_adaptor.core.patching import PatchSet

        ps = PatchSet(self.name)
        ps.wrap("mm_adaptor.patches.transformer.context_parallel.context_parallel_attention", _wrong(**self.broken))
        return [ps]


@register
class RingWithoutDiagonalMask(_BrokenContextParallel):
    name = "test-broken-cp-ring-diagonal"
    description = "--context-parallel-algo megatron_cp_algo without the causal mask of the diagonal blocks"
    flags = (Flag("--use-test-broken-cp-ring-diagonal", description),)
    broken = {"diagonal_causal": False}


@register
class UlyssesHeadsMisordered(_BrokenContextParallel):
    name = "test-broken-cp-ulysses-heads"
    description = "--context-parallel-algo ulysses_cp_algo gathering the heads in reverse order"
    flags = (Flag("--use-test-broken-cp-ulysses-heads", description),)
    broken = {"head_order": [1, 0]}


@register
class RingWithScoresOffByALittle(_BrokenContextParallel):
    name = "test-broken-cp-ring-scale"
    description = "--context-parallel-algo megatron_cp_algo with the softmax scale 0.1% too large"
    flags = (Flag("--use-test-broken-cp-ring-scale", description),)
    broken = {"scale_factor": 1.001}


@register
class PackedAttentionAcrossSegments(_BrokenContextParallel):
    name = "test-broken-cp-packed-across"
    description = "--context-parallel-size with --packing letting attention cross the samples of a pack"
    flags = (Flag("--use-test-broken-cp-packed-across", description),)
    broken = {"cross_segments": True}
