"""Deliberately wrong context parallelism for the harness's self-test (loaded into the training ranks through
MM_ADAPTOR_FEATURE_MODULES), each beside the real --context-parallel-size 2: a ring that forgets the causal mask of
its diagonal blocks (each token also sees the later tokens of its own chunk), a ring whose softmax scale is 0.1%
too large (a subtle forward error), Ulysses that gathers the heads in the wrong order, packed attention that
crosses the samples of a pack, and packed attention that lets each token see the next one of its sample."""

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


def _one_token_ahead(wrapped, instance, args, kwargs):
    """The packed mask with each query also seeing the next token of its own segment."""
    masked = wrapped(*args, **kwargs)
    (q_segment, q_position), (k_segment, k_position) = args[0], args[1]

    def leaky(start, rows):
        ahead = ((k_position[None, :] == q_position[start:start + rows, None] + 1)
                 & (k_segment[None, :] == q_segment[start:start + rows, None]))
        return masked(start, rows) & ~ahead

    return leaky


@register
class PackedAttentionOneTokenAhead(Feature):
    name = "test-broken-cp-packed-ahead"
    description = "--context-parallel-size with --packing letting each token see the next token of its sample"
    flags = (Flag("--use-test-broken-cp-packed-ahead", description),)

    def patch_sets(self, options):
        from mm_adaptor.core.patching import PatchSet

        ps = PatchSet(self.name)
        ps.wrap("mm_adaptor.patches.transformer.context_parallel_packed._hidden", _one_token_ahead)
        return [ps]
