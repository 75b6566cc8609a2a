"""Vision-language models built from megatron-core modules, one package per family."""

import importlib


def family_package(config):
    """The model package a family's config dataclass belongs to (mm_adaptor.models.<family>)."""
    return importlib.import_module(type(config).__module__.rsplit(".", 1)[0])


def rope_index_for(config, *args, **kwargs):
    """The 3-D rope index of the config's family (its package's rope_index_for)."""
    return family_package(config).rope_index_for(config, *args, **kwargs)
