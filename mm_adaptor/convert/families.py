"""Which mapping table a Hugging Face config belongs to: its model_type's family in the model registry."""

from __future__ import annotations

from mm_adaptor.models import registry
from mm_adaptor.models.hf_config import config_dict


def _module(config):
    cfg = config_dict(config)
    return registry.spec_for_hf_config(cfg).mapping_module(), cfg


def family_for(config):
    """The rules.Family of an HF config (dict or transformers config); ValueError names an unknown model_type."""
    module, cfg = _module(config)
    return module.family(cfg)


def dims_for(config) -> dict:
    """The sizes the layout checks need (heads, key/value groups, layers per tower), from the family's module."""
    module, cfg = _module(config)
    return module.dims(cfg)


# megatron's TransformerBlock saves each layer under a key of its own (`...layers.<n>.`) instead of one stack when its
# layers differ (TransformerBlock.sharded_state_dict, 0.16 to 0.19): a MoE or linear-attention layer pattern given as
# a list or a frequency above 1, heterogeneous block specs
def _layers_saved_apart(transformer_config) -> bool:
    def patterned(value) -> bool:
        return isinstance(value, list) or (isinstance(value, int) and not isinstance(value, bool) and value > 1)

    return bool(getattr(transformer_config, "hetereogenous_dist_checkpoint", False)
                or getattr(transformer_config, "heterogeneous_block_specs", False)
                or patterned(getattr(transformer_config, "moe_layer_freq", 1))
                or patterned(getattr(transformer_config, "linear_attention_freq", None)))


TOWERS = {"language_model.decoder.layers.": "language_transformer_config",
          "vision_model.decoder.layers.": "vision_transformer_config"}


def checkpoint_family(config, layout: str | None = None, writing: bool = False):
    """family_for(config), checked against the family's own model and told how megatron keys its checkpoint.

    A family whose checkpoints come in several layouts (its mapping's LAYOUTS, the first the one written by
    default) reads the config's own and writes `layout` (`mcore-to-hf --layout`); the Family's config is then that
    layout's config.json. A layout the family lacks is a ValueError.

    - the family's config reader (what the driver and `mm-adaptor generate` build the model from) must take the
      config: its ValueError (or KeyError) refuses the conversion before anything is written;
    - Family.per_layer_keys, where the mapping leaves it empty, from megatron's own rule on each tower's
      TransformerConfig (see _layers_saved_apart)."""
    cfg = config_dict(config)
    spec = registry.spec_for_hf_config(cfg)
    module = spec.mapping_module()
    layouts = getattr(module, "LAYOUTS", ())
    if layout is not None and layout not in layouts:
        raise ValueError(f"--layout {layout}: " + (f"{spec.name} checkpoints are written as {', '.join(layouts)}"
                                                    if layouts else f"{spec.name} checkpoints have one layout"))
    family = module.family(cfg, layout=layout or layouts[0]) if layouts and writing else module.family(cfg)
    if spec.package is None:
        return family
    model_config = spec.config_from_hf(cfg)
    if not family.per_layer_keys:
        package = spec.package_module()
        family.per_layer_keys = tuple(
            prefix for prefix, builder in TOWERS.items()
            if hasattr(package, builder) and _layers_saved_apart(getattr(package, builder)(model_config)))
    return family
