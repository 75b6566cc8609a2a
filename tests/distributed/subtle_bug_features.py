"""Deliberately, subtly wrong features that claim the fused kernels' (inexact) tolerance, registered only for the
harness's self-test (loaded into the training ranks through MM_ADAPTOR_FEATURE_MODULES). The harness must reject
each in fp32 and in bf16."""

from mm_adaptor.core.features import Feature, Flag, fused_kernel_tolerance, register
from mm_adaptor.core.patching import PatchSet

LAYER = "megatron.core.transformer.transformer_layer.TransformerLayer.__init__"


def _first_layer_activation_off_by_0_2_percent(wrapped, instance, args, kwargs):
    """Like a fused activation kernel that is wrong by 0.2%: computed in fp32 and rounded once, so the error
    survives bf16 rounding on average (scaling an already rounded bf16 output would mostly round back)."""
    wrapped(*args, **kwargs)
    mlp = instance.mlp
    if instance.layer_number == 1 and hasattr(mlp, "activation_func"):
        right = mlp.activation_func
        mlp.activation_func = lambda x: (right(x.float()) * 1.002).to(x.dtype)


def _every_layer_mlp_output_off_by_0_2_percent(wrapped, instance, args, kwargs):
    """Every layer's MLP output x 1.002: its activation scaled in fp32 and rounded once (fc2 is linear, so its
    product is scaled too, summed in fp32 and rounded once). Less than half a bf16 ulp per element, same sign
    everywhere."""
    wrapped(*args, **kwargs)
    mlp = instance.mlp
    if hasattr(mlp, "activation_func"):
        right = mlp.activation_func
        mlp.activation_func = lambda x: (right(x.float()) * 1.002).to(x.dtype)


def _first_layer_fc2_weight_gradient_times_0_98(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    if instance.layer_number == 1:
        instance.mlp.linear_fc2.weight.register_hook(lambda grad: grad * 0.98)


def _layer_patch(name, wrapper):
    ps = PatchSet(name)
    ps.wrap(LAYER, wrapper)
    return [ps]


@register
class MlpActivationOff(Feature):
    name = "test-mlp-activation-off"
    description = "layer 1's MLP activation multiplied by 1.002, claiming the fused kernels' tolerance"
    flags = (Flag("--use-test-mlp-activation-off", description),)
    tolerance = fused_kernel_tolerance("claims to be a rounding-level change")

    def patch_sets(self, options):
        return _layer_patch(self.name, _first_layer_activation_off_by_0_2_percent)


@register
class EveryMlpOutputOff(Feature):
    name = "test-every-mlp-output-off"
    description = "every layer's MLP output multiplied by 1.002, claiming the fused kernels' tolerance"
    flags = (Flag("--use-test-every-mlp-output-off", description),)
    tolerance = fused_kernel_tolerance("claims to be a rounding-level change")

    def patch_sets(self, options):
        return _layer_patch(self.name, _every_layer_mlp_output_off_by_0_2_percent)


@register
class Fc2WeightGradientOff(Feature):
    name = "test-fc2-wgrad-off"
    description = "layer 1's linear_fc2 weight gradient multiplied by 0.98, claiming the fused kernels' tolerance"
    flags = (Flag("--use-test-fc2-wgrad-off", description),)
    tolerance = fused_kernel_tolerance("claims to be a rounding-level change")

    def patch_sets(self, options):
        return _layer_patch(self.name, _first_layer_fc2_weight_gradient_times_0_98)
