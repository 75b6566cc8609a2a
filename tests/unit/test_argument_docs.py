"""Megatron's parser reads its config classes' field docstrings from their source on every parse (0.17+); the
trainer reads them once per class, and the server ranks fork from reads them for every rank: the options' help is
Megatron's own either way."""

import argparse
import inspect

import pytest

from mm_adaptor.core.patching import PatchSet
from mm_adaptor.train import argument_docs


def megatron_parser():
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_megatron_arguments(parser)
    return {action.dest: action.help for action in parser._actions}


@pytest.fixture
def source_reads(monkeypatch):
    if argument_docs.factory() is None:
        pytest.skip("this megatron's parser does not read docstrings from source (megatron.training 0.17+ does)")
    reads, read = [], inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: reads.append(obj) or read(obj))
    monkeypatch.setattr(argument_docs, "_DOCSTRINGS", {})
    return reads


def test_each_class_is_read_once_and_the_help_is_megatrons(source_reads):
    plain = megatron_parser()
    once = len(source_reads)
    assert once >= 10 and len(set(source_reads)) == once  # a dozen config classes and their bases, each once
    patches = PatchSet("remembered")
    patches.wrap(f"{argument_docs.FACTORY}._get_field_docstrings", argument_docs.remembered)
    patches.apply()
    try:
        first, second = megatron_parser(), megatron_parser()
    finally:
        patches.revert()
    assert first == second == plain
    assert len(source_reads) == 2 * once, "the second parser read the sources again"


def test_warming_reads_every_class_the_parser_builds_from(source_reads):
    argument_docs.warm()
    warmed = len(source_reads)
    assert warmed >= 10 and argument_docs.factory()._get_field_docstrings.__name__ == "_get_field_docstrings"
    patches = PatchSet("remembered")
    patches.wrap(f"{argument_docs.FACTORY}._get_field_docstrings", argument_docs.remembered)
    patches.apply()
    try:
        megatron_parser()
    finally:
        patches.revert()
    assert len(source_reads) == warmed, "a class the warm-up left out was read in the rank"
