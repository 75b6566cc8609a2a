"""A deliberately wrong --balanced-moe-experts, registered only for the harness's self-test (loaded into the training
ranks through MM_ADAPTOR_FEATURE_MODULES): it copies the hot experts and computes their tokens like the real feature,
and the copies' gradients still meet in the owner's reduce, but the owner does not return the sum to its parameters
(a hot expert's gradient not returned). It must fail the check."""

from collections import Counter

from mm_adaptor.core.features import Feature, Flag, register
from mm_adaptor.feature_flags.balanced_moe_experts import BalancedMoEExperts, balanced_patch_sets
from mm_adaptor.patches.transformer import balanced_moe_experts as bm
from mm_adaptor.versions import contracts


class GradientNotReturned(bm.HotExpertCopy):
    @staticmethod
    def backward(ctx, *grads):
        bm.HotExpertCopy.backward(ctx, *grads)  # every rank still takes part in the reduce
        return (None,) * (7 + ctx.sources)


@register
class BalancedMoEGradientNotReturned(Feature):
    name = "test-balanced-moe-gradient-not-returned"
    description = "--balanced-moe-experts whose owners drop the hot experts' summed gradients"
    flags = (Flag("--use-test-balanced-moe-gradient-not-returned", description),)
    tolerance = BalancedMoEExperts.tolerance

    def __init__(self):
        self.counts = Counter()

    def statistics(self):
        return dict(self.counts) or None

    def patch_sets(self, options):
        return balanced_patch_sets(self.name, 1, 1, self.counts, copy_class=GradientNotReturned)


contracts.verified_like(BalancedMoEGradientNotReturned.name, "balanced-moe-experts")
