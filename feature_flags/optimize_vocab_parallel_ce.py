"""--optimize-vocab-parallel-ce: the boolean-indexed writes in the vocab-parallel cross-entropy become torch.where."""

from mm_adaptor.core.features import Feature, Flag, Tolerance, register
from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet
from mm_adaptor.core.verification import NO_GPU, TP2_DISTOPT, fake_npu_check, same_everywhere

TARGET = "megatron.core.tensor_parallel.cross_entropy.VocabParallelCrossEntropy.calculate_predicted_logits"


@register
class OptimizeVocabParallelCE(Feature):
    name = "optimize-vocab-parallel-ce"
    devices = same_everywhere(NO_GPU, fake_npu_check(TP2_DISTOPT))
    description = ("vocab-parallel cross-entropy zeroes out-of-shard targets and their logits with torch.where "
                   "instead of boolean-indexed writes (x[mask] = 0); same values, non-finite logits included. For "
                   "devices whose index_put_ runs nonzero + scatter and a host sync (MindSpeed makes this rewrite "
                   "for Ascend NPUs; not verified here). No gain on CPU or CUDA, where PyTorch already runs those "
                   "writes as masked_fill_ without a sync (CPU: no difference beyond noise, benchmarks/RESULTS.md)")
    flags = (Flag("--optimize-vocab-parallel-ce", description),)
    tolerance = Tolerance(exact=True, why="torch.where selects exactly the values the masked writes leave")

    def patch_sets(self, options):
        from mm_adaptor.patches.tensor_parallel.cross_entropy import calculate_predicted_logits_without_masked_writes

        ps = PatchSet(self.name)
        ps.replace(TARGET, staticmethod(calculate_predicted_logits_without_masked_writes),
                   contract=Contract(versions=SUPPORTED_MEGATRON_CORE, fingerprint="b41b9f2f82d6dcc6"))
        return [ps]
