"""A deliberately wrong --moe-zero-memory, registered only for the harness's self-test (loaded into the training
ranks through MM_ADAPTOR_FEATURE_MODULES): it releases the experts' input like the real feature, but the input it
dispatches again has one element one ulp larger. It claims bit-for-bit and must fail."""

from collections import Counter

import torch

from mm_adaptor.core.features import BIT_FOR_BIT, Feature, Flag, register
from mm_adaptor.patches.transformer import moe_zero_memory as zm
from mm_adaptor.versions import contracts


class OneUlpOff(zm.Redispatch):
    def dispatch_again(self):
        delivered = super().dispatch_again()
        if delivered.numel():
            first = delivered.view(-1)[:1]
            first.copy_(torch.nextafter(first, torch.full_like(first, float("inf"))))
        return delivered


@register
class MoEZeroMemoryOneUlpOff(Feature):
    name = "test-moe-zero-memory-one-ulp-off"
    description = "--moe-zero-memory level0 whose re-dispatched experts' input has one element one ulp off"
    flags = (Flag("--use-test-moe-zero-memory-one-ulp-off", description),)
    tolerance = BIT_FOR_BIT

    def __init__(self):
        self.counts = Counter()

    def statistics(self):
        return dict(self.counts) or None

    def patch_sets(self, options):
        from mm_adaptor.feature_flags.moe_zero_memory import zero_memory_patch_sets

        return zero_memory_patch_sets(self.name, "level0", None, self.counts, redispatch_class=OneUlpOff)


contracts.verified_like(MoEZeroMemoryOneUlpOff.name, "moe-zero-memory")
