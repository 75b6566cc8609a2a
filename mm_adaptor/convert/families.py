"""Which mapping table a Hugging Face config belongs to (its model_type)."""

from __future__ import annotations

import importlib

FAMILIES = {"qwen2_5_vl": "mm_adaptor.models.qwen2_5_vl.mapping"}


def _module(config):
    cfg = config if isinstance(config, dict) else config.to_dict()
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} has no mapping table (known: {', '.join(FAMILIES)})")
    return importlib.import_module(FAMILIES[model_type]), cfg


def family_for(config):
    """The rules.Family of an HF config (dict or transformers config); ValueError names an unknown model_type."""
    module, cfg = _module(config)
    return module.family(cfg)


def dims_for(config) -> dict:
    """The sizes the layout checks need (heads, key/value groups, layers per tower), from the family's module."""
    module, cfg = _module(config)
    return module.dims(cfg)
