"""A deliberately wrong --swap-attention, registered only for the harness's self-test (loaded into the training
ranks through MM_ADAPTOR_FEATURE_MODULES): it swaps like the real feature, but a storage's prefetch copies back
the host copy of the same-sized storage saved by the layer below it in the same micro-batch (the layer above for
the lowest layer). It swaps every layer, the last included (--swap-select all), so that each has a neighbour in host
memory. It claims bit-for-bit and must fail, in fp32 and bf16."""

from mm_adaptor.versions import contracts
from mm_adaptor.core.features import BIT_FOR_BIT, Feature, Flag, register


def _neighbour_source_manager():
    from mm_adaptor.patches.transformer.swap_attention import SwapManager

    class PrefetchesAnotherLayersTensors(SwapManager):
        def host_source(self, stored):
            layers = stored.layer.block.layers
            index = layers.index(stored.layer)
            for neighbour in (index - 1, index + 1):
                if 0 <= neighbour < len(layers):
                    for other in layers[neighbour].live():
                        if other.state == "host" and other.nbytes == stored.nbytes:
                            return other.host
            return stored.host

    return PrefetchesAnotherLayersTensors


@register
class SwapAttentionFromAnotherLayer(Feature):
    name = "test-swap-attention-other-layer"
    description = "swap attention whose prefetch returns the layer below's tensors, claiming bit-for-bit"
    flags = (Flag("--use-test-swap-attention-other-layer", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        from mm_adaptor.feature_flags.swap_attention import patch_set

        return [patch_set(self.name, _neighbour_source_manager()(min_bytes=0, select="all"))]


contracts.verified_like(SwapAttentionFromAnotherLayer.name, "swap-attention")
