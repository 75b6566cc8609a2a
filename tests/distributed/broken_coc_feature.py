"""A deliberately wrong --use-coc for the harness's self-test (loaded into the training ranks through
MM_ADAPTOR_FEATURE_MODULES): each chunk's product lands in the next chunk's rows."""

from mm_adaptor.core.features import BIT_FOR_BIT, Feature, Flag, register


@register
class ChunksInTheWrongOrder(Feature):
    name = "test-broken-coc"
    description = "--use-coc with the column-parallel chunks re-assembled in the wrong order"
    flags = (Flag("--use-test-broken-coc", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        from mm_adaptor.core.patching import PatchSet
        from mm_adaptor.patches.tensor_parallel import coc

        ps = PatchSet(self.name)
        ps.wrap("megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce",
                coc.ChunkedLinears(2).linear_under_sequence_parallel)
        ps.replace("mm_adaptor.patches.tensor_parallel.coc_autograd.AllGatherMatmul.slot",
                   staticmethod(lambda c, chunks: (c + 1) % chunks))
        return [ps]
