"""HF <-> Megatron checkpoint conversion (`mm-adaptor convert`), streaming shard by shard over a per-family mapping
table.

The pure functions below work on whole (unsharded) tensors held in memory, real or meta; the command
(mm_adaptor.convert.cli) streams the same rules over files."""

from __future__ import annotations


class ConvertError(ValueError):
    """A refusal: one line, said before anything is written."""


def family_for(config):
    from mm_adaptor.convert.families import family_for as find

    return find(config)


def unknown_and_missing(family, hf_names) -> tuple[list[str], list[str]]:
    """HF names no rule knows, and the names the rules need that are absent (both sorted)."""
    index = family.hf_index()
    names = {family.canonical_hf(name) for name in hf_names}
    unknown = sorted(name for name in names if name not in index and name not in family.ignored_hf)
    missing = sorted(name for name in index if name not in names)
    return unknown, missing


def check_names(family, hf_names) -> None:
    unknown, missing = unknown_and_missing(family, hf_names)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ConvertError(f"unknown key {unknown[0]}{more}: the {family.name} mapping has no rule for it")
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConvertError(f"missing key {missing[0]}{more}: the {family.name} mapping needs it")


def hf_to_mcore_tensors(family, hf_tensors: dict) -> dict:
    """{HF name: tensor} (legacy or in-memory names) -> {Megatron state-dict name: tensor}, e.g.
    `language_model.decoder.layers.3.self_attention.linear_qkv.weight`. Refuses unknown and missing names."""
    from mm_adaptor.convert.rules import to_mcore

    hf = {family.canonical_hf(name): tensor for name, tensor in hf_tensors.items()}
    check_names(family, hf)
    out = {}
    for rule in family.rules:
        for layer in family.layers(rule):
            out[rule.mcore_name(layer)] = to_mcore(rule, [hf[name] for name in rule.hf_names(layer)])
    return out


def mcore_to_hf_tensors(family, mcore_tensors: dict) -> dict:
    """{Megatron state-dict name: tensor} -> {HF name as save_pretrained writes it: tensor}."""
    from mm_adaptor.convert.rules import to_hf

    expected = {rule.mcore_name(layer) for rule in family.rules for layer in family.layers(rule)}
    names = {name for name in mcore_tensors if not name.endswith("._extra_state")}
    if names - expected:
        raise ConvertError(f"unknown Megatron name {sorted(names - expected)[0]}")
    if expected - names:
        raise ConvertError(f"missing Megatron name {sorted(expected - names)[0]}")
    out = {}
    for rule in family.rules:
        for layer in family.layers(rule):
            out.update(zip(rule.hf_names(layer), to_hf(rule, mcore_tensors[rule.mcore_name(layer)])))
    return out
