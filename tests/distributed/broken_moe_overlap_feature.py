"""A deliberately wrong --moe-alltoall-overlap-comm, registered only for the harness's self-test (loaded into the
training ranks through MM_ADAPTOR_FEATURE_MODULES): the last chunk's rows of its first local expert are computed by
the chunk's other expert (or, with one expert per chunk, by the previous chunk's expert) — a chunk's tokens sent to
the wrong expert. Everything else (chunks, all-to-alls, order) is the real feature's. It claims bit-for-bit and must
fail."""

from collections import Counter

from mm_adaptor.core.features import BIT_FOR_BIT, Feature, Flag, register
from mm_adaptor.versions import contracts


def wrong_expert(j, chunk):
    j0, j1 = chunk.experts
    if j0 == 0 or j != j0:  # the first chunk is right: only the last chunks' first expert is wrong
        return j
    return j0 + 1 if j1 - j0 > 1 else j0 - 1


@register
class MoEOverlapWrongExpert(Feature):
    name = "test-moe-overlap-wrong-expert"
    description = "--moe-alltoall-overlap-comm whose later chunks' first expert computes another expert's rows"
    flags = (Flag("--use-test-moe-overlap-wrong-expert", description),)
    tolerance = BIT_FOR_BIT

    def __init__(self):
        self.counts = Counter()

    def statistics(self):
        return dict(self.counts) or None

    def patch_sets(self, options):
        from mm_adaptor.feature_flags.moe_alltoall_overlap import chunks_of, overlap_patch_sets

        return overlap_patch_sets(self.name, chunks_of(options), self.counts, expert_for=wrong_expert)


contracts.verified_like(MoEOverlapWrongExpert.name, "moe-alltoall-overlap-comm")
