"""Deliberately wrong variants of --optimize-vocab-parallel-ce, registered only for the harness's self-test
(loaded into the training ranks through MM_ADAPTOR_FEATURE_MODULES)."""

from mm_adaptor.core.features import BIT_FOR_BIT, Feature, Flag, register
from mm_adaptor.core.patching import PatchSet

CE = "megatron.core.tensor_parallel.cross_entropy.VocabParallelCrossEntropy"


def _forward_off_by_one_ulp_ish(*args):
    from mm_adaptor.patches.tensor_parallel.cross_entropy import calculate_predicted_logits_by_mask_multiply

    target_mask, masked_target_1d, predicted, sum_exp, exp_logits = calculate_predicted_logits_by_mask_multiply(*args)
    return target_mask, masked_target_1d, predicted * (1 + 2**-20), sum_exp, exp_logits


def _gradients_slightly_wrong(grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output):
    grad_2d[arange_1d, masked_target_1d] -= softmax_update * (1 - 2**-18)
    grad_input.mul_(grad_output.unsqueeze(dim=-1))
    return grad_input


@register
class BrokenForwardCE(Feature):
    name = "test-broken-forward-ce"
    description = "a wrong cross-entropy forward that claims to be bit-for-bit"
    flags = (Flag("--use-test-broken-forward-ce", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        ps = PatchSet(self.name)
        ps.replace(f"{CE}.calculate_predicted_logits", staticmethod(_forward_off_by_one_ulp_ish))
        return [ps]


@register
class BrokenBackwardCE(Feature):
    name = "test-broken-backward-ce"
    description = "a wrong cross-entropy backward (losses of step 1 unchanged) that claims to be bit-for-bit"
    flags = (Flag("--use-test-broken-backward-ce", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        ps = PatchSet(self.name)
        ps.replace(f"{CE}.calculate_gradients", staticmethod(_gradients_slightly_wrong))
        return [ps]
