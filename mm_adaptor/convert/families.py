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
