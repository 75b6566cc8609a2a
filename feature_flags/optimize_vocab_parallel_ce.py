"""--optimize-vocab-parallel-ce: masked writes in the vocab-parallel cross-entropy become multiplies."""

from mm_adaptor.features import Feature, Flag, Tolerance, register
from mm_adaptor.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

TARGET = "megatron.core.tensor_parallel.cross_entropy.VocabParallelCrossEntropy.calculate_predicted_logits"


@register
class OptimizeVocabParallelCE(Feature):
    name = "optimize-vocab-parallel-ce"
    description = ("vocab-parallel cross-entropy zeroes out-of-shard targets by multiplying with the inverted "
                   "mask instead of boolean-indexed writes (no nonzero/scatter, no host sync); same values")
    flags = (Flag("--optimize-vocab-parallel-ce", description),)
    tolerance = Tolerance(exact=True, why="multiplying by 1 or 0 yields exactly what the masked writes yielded")

    def patch_sets(self, options):
        from mm_adaptor.patches.tensor_parallel.cross_entropy import calculate_predicted_logits_by_mask_multiply

        ps = PatchSet(self.name)
        ps.replace(TARGET, staticmethod(calculate_predicted_logits_by_mask_multiply),
                   contract=Contract(versions=SUPPORTED_MEGATRON_CORE, fingerprint="b41b9f2f82d6dcc6"))
        return [ps]
