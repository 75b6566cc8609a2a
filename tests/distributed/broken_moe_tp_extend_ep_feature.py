"""A deliberately wrong --moe-tp-extend-ep, registered only for the harness's self-test (loaded into the training
ranks through MM_ADAPTOR_FEATURE_MODULES): it sets megatron's expert layout like the real feature, but assigns each
expert to the wrong rank: the global expert index a token is routed to is off by one rank's worth of experts (the
routing map and probabilities rolled by the local expert count), so expert g's tokens are computed by the weights of
expert g + local count, on the next expert-parallel rank."""

from collections import Counter

import torch

from mm_adaptor.core.features import Feature, Flag, register
from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet
from mm_adaptor.feature_flags import moe_tp_extend_ep as real
from mm_adaptor.versions import contracts

ROUTE = "megatron.core.transformer.moe.moe_layer.MoELayer.route"


@register
class MoETpExtendEpOffByOneRank(Feature):
    name = "test-moe-tp-extend-ep-off-by-one-rank"
    description = "--moe-tp-extend-ep whose global expert index is one expert-parallel rank off"
    flags = (Flag("--use-test-moe-tp-extend-ep-off-by-one-rank", description),)
    tolerance = real.MoETpExtendEp.tolerance
    regroups_experts = True
    changes_parameter_layout = True

    def __init__(self):
        self.counts = Counter()

    def statistics(self):
        return dict(self.counts) or None

    def megatron_arguments(self, options):
        return real.megatron_values(options)

    def patch_sets(self, options):
        counts = self.counts

        def routed_one_rank_off(wrapped, instance, args, kwargs):
            probs, routing_map = wrapped(*args, **kwargs)
            counts["routings one rank off"] += 1
            shift = instance.num_local_experts
            return torch.roll(probs, shift, dims=-1), torch.roll(routing_map, shift, dims=-1)

        ps = PatchSet(self.name)
        ps.wrap(ROUTE, routed_one_rank_off, contract=Contract(versions=SUPPORTED_MEGATRON_CORE))
        return [ps]


contracts.verified_like(MoETpExtendEpOffByOneRank.name, "moe-tp-extend-ep")
