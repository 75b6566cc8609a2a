"""megatron-core's HybridStack (0.18 and newer: HybridModel's decoder, one layer per pattern symbol) for the features
that hook megatron's TransformerBlock: the same wrappers, reaching HybridStack too.

HybridStack's layers are TransformerLayers (attention '*', MLPLayer '-', MoETransformerLayer 'E'), so the layer
wrappers reach them unchanged; what a feature does when a TransformerBlock is built or run, it must also do for a
HybridStack. The wraps are registered on every release (so the fingerprint table records the target from the base
release on, as None where it is not defined) and applied where the class exists."""

from __future__ import annotations

from mm_adaptor.core.patching import _MISSING, Patch, PatchError, resolve

HYBRID_STACK = "megatron.core.models.hybrid.hybrid_block.HybridStack"


class WhereDefined(Patch):
    """A wrap applied only where its target exists: on a release without it there is nothing to patch (and nothing
    that could call it), so apply leaves it unapplied instead of failing."""

    def apply(self, *, scanned=None) -> None:
        try:
            owner, name = resolve(self.target)
        except PatchError:
            return
        if Patch._raw_attribute(owner, name)[0] is _MISSING:
            return
        super().apply(scanned=scanned)


def wrap_where_defined(patch_set, target: str, wrapper, contract) -> Patch:
    return patch_set.add(WhereDefined(target, wrapper, mode="wrap", contract=contract, feature=patch_set.name))


def mlp_layer_indices(layers) -> list[int]:
    """Indices of the layers that hold an MLP (dense or MoE): in a HybridStack, the '-' and 'E' layers."""
    from megatron.core.transformer.identity_op import IdentityOp

    return [i for i, layer in enumerate(layers)
            if getattr(layer, "mlp", None) is not None and not isinstance(layer.mlp, IdentityOp)]
