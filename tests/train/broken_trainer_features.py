"""Deliberately broken variants of the trainer's mechanisms (loaded into its ranks through
MM_ADAPTOR_FEATURE_MODULES), each of which its test must reject: evaluation on the training split, and a stop on
SIGTERM that does not save."""

from mm_adaptor.core.features import BIT_FOR_BIT, Feature, Flag, register
from mm_adaptor.core.patching import PatchSet


@register
class EvaluationOnTheTrainingSplit(Feature):
    name = "test-eval-on-train-split"
    description = "a broken trainer whose validation and test batches are the training split's"
    flags = (Flag("--test-eval-on-train-split", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        ps = PatchSet(self.name)
        ps.replace("mm_adaptor.train.providers._split_args", lambda args, split: args)
        return [ps]


@register
class StopWithoutSaving(Feature):
    name = "test-stop-without-saving"
    description = "a broken trainer that stops on SIGTERM (exit 0) without saving a checkpoint"
    flags = (Flag("--test-stop-without-saving", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        ps = PatchSet(self.name)
        ps.replace("megatron.training.training.save_checkpoint_and_time", lambda *args, **kwargs: None)
        return [ps]


@register
class LoraGradientsNotSummed(Feature):
    name = "test-lora-unsummed-gradients"
    description = "a broken LoRA whose whole factors' gradients are not summed over the sequence-parallel ranks"
    flags = (Flag("--test-lora-unsummed-gradients", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        ps = PatchSet(self.name)
        ps.replace("mm_adaptor.lora.layers.mark_sequence_parallel", lambda whole, layer: None)
        return [ps]


def _expert_delta_without_summed_gradients(self, x, mappings):
    import torch.nn.functional as F

    return F.linear(F.linear(x, self.lora_A.weight), self.lora_B.weight) * self.lora_shape.scaling


@register
class LoraExpertGradientsNotSummed(Feature):
    name = "test-lora-unsummed-expert-gradients"
    description = "a broken LoRA whose experts' whole factors' gradients are not summed over the expert-TP ranks"
    flags = (Flag("--test-lora-unsummed-expert-gradients", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        ps = PatchSet(self.name)
        ps.replace("mm_adaptor.lora.layers.LoraLinear._expert_lora_delta", _expert_delta_without_summed_gradients)
        return [ps]


@register
class LoraRecomputeWithoutGradients(Feature):
    name = "test-lora-recompute-no-grad"
    description = "a broken LoRA whose fully recomputed blocks take hidden states without a gradient"
    flags = (Flag("--test-lora-recompute-no-grad", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        ps = PatchSet(self.name)
        ps.replace("mm_adaptor.lora.recomputed_blocks_take_gradients", lambda model: 0)
        return [ps]
