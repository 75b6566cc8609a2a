"""Megatron's argument parser (0.17+) takes each option's help from its config dataclass's field docstrings, which
ArgumentGroupFactory reads from the class's source with inspect and ast on every parse: about 0.3 s of CPU in every
rank and launcher. A class gives the same docstrings every time, so the trainer keeps them per class
(`remembered`, in its patch set), and the server that ranks fork from reads them once for every rank (`warm`)."""

from __future__ import annotations

import argparse
import contextlib

FACTORY = "megatron.training.argument_utils.ArgumentGroupFactory"
_DOCSTRINGS: dict[type, dict[str, str]] = {}


def factory():
    """Megatron's ArgumentGroupFactory where it reads docstrings from source (megatron.training 0.17+), else None."""
    try:
        from megatron.training.argument_utils import ArgumentGroupFactory
    except ImportError:
        return None
    return ArgumentGroupFactory if "_get_field_docstrings" in vars(ArgumentGroupFactory) else None


def _read_once(read, config_class) -> dict[str, str]:
    known = _DOCSTRINGS.get(config_class)
    if known is None:
        known = _DOCSTRINGS[config_class] = read(config_class)
    return dict(known)  # a copy each time: callers own theirs


def remembered(wrapped, _instance, args, kwargs):
    """ArgumentGroupFactory._get_field_docstrings, read once per class."""
    (config_class,) = [*args, *kwargs.values()]
    return _read_once(wrapped, config_class)


def warm() -> None:
    """Read the docstrings of every class Megatron's parser builds from (on a parser of its own, thrown away)."""
    owner = factory()
    if owner is None:
        return
    from megatron.training.arguments import add_megatron_arguments

    read = owner._get_field_docstrings
    owner._get_field_docstrings = lambda self, config_class: _read_once(lambda c: read(self, c), config_class)
    try:
        with contextlib.suppress(Exception):  # a cold cache only costs the reads it would have saved
            add_megatron_arguments(argparse.ArgumentParser(add_help=False))
    finally:
        owner._get_field_docstrings = read
