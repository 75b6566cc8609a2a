"""Test-only features for the MoE load-balancing test (loaded into the trainer's ranks through
MM_ADAPTOR_FEATURE_MODULES): a skewed router initialisation, and a broken variant whose load-balancing loss is
computed but not added to the gradients."""

from mm_adaptor.core.features import BIT_FOR_BIT, Feature, Flag, register
from mm_adaptor.core.patching import PatchSet

# The skew: every MoE layer's pre-MLP LayerNorm bias is SKEW along u = ones / sqrt(hidden) and its router's first
# expert row points along u, so each token's logit for expert 0 exceeds the others' by about SKEW * ROUTER: expert 0
# takes every token (a coefficient of variation of 0.58 with 4 experts, top-2), which the aux loss can still move
# in 50 steps.
SKEW, ROUTER = 1.5, 1.0


def _skewed(wrapped, layer, args, kwargs):
    import torch
    from megatron.core.transformer.moe.moe_layer import MoELayer

    wrapped(*args, **kwargs)
    if not isinstance(getattr(layer, "mlp", None), MoELayer):
        return
    norm, router = layer.pre_mlp_layernorm, layer.mlp.router
    hidden = router.weight.shape[1]
    direction = torch.full((hidden,), hidden ** -0.5)
    with torch.no_grad():
        norm.bias.copy_(SKEW * direction)
        router.weight[0].add_(ROUTER * direction.to(router.weight.dtype))


@register
class SkewedRouter(Feature):
    name = "test-skewed-router"
    description = "every MoE layer's routing starts skewed towards expert 0 (an initialisation, for a test)"
    flags = (Flag("--test-skewed-router", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        ps = PatchSet(self.name)
        ps.wrap("megatron.core.transformer.transformer_layer.TransformerLayer.__init__", _skewed)
        return [ps]


@register
class AuxLossNotAdded(Feature):
    name = "test-aux-loss-not-added"
    description = "a broken MoE load balancing: its loss is computed and logged, its gradient never added"
    flags = (Flag("--test-aux-loss-not-added", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        ps = PatchSet(self.name)
        ps.replace("megatron.core.transformer.moe.moe_utils.MoEAuxLossAutoScaler.apply",
                   staticmethod(lambda activation, aux_loss: activation))
        return [ps]
