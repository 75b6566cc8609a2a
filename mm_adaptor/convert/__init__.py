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


def installed_transformers_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def installed_transformers_major() -> int | None:
    version = installed_transformers_version()
    return int(version.split(".")[0]) if version else None


def fused_layout_major(family) -> int:
    """Which transformers' layout a checkpoint's fused experts are in: the major version that saved its config
    (config.json's transformers_version; never guessed from shapes, a square expert matrix reads either way), else,
    for a config without one (an in-memory state dict), the installed transformers'."""
    from mm_adaptor.models.hf_config import saved_by

    major = saved_by(family.config) or installed_transformers_major()
    if major is None:
        raise ConvertError("the HF config has no transformers_version and transformers is not installed: the layout "
                           "of fused experts is unknown")
    return major


def unknown_and_missing(family, hf_names) -> tuple[list[str], list[str]]:
    """HF names no rule knows, and the names the rules need that are absent (both sorted); a fused experts name
    stands for the per-expert names it holds."""
    index = family.hf_index()
    names = set(family.expand_fused([family.canonical_hf(name) for name in hf_names]))
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


def split_fused(family, name: str, tensor, major: int) -> list[tuple[str, object]]:
    """[(per-expert HF name, tensor)] of a fused experts tensor in transformers `major`'s layout (views of it)."""
    from mm_adaptor.convert.rules import split_experts

    fused, held = family.fused_index()[name]
    if tensor.shape[0] * len(fused.parts) != len(held):
        raise ConvertError(f"{name}: {tensor.shape[0]} experts, the config says {len(held) // len(fused.parts)}")
    parts = [part for expert in split_experts(tensor, len(fused.parts), major) for part in expert]
    return list(zip(held, parts))


def hf_to_mcore_tensors(family, hf_tensors: dict) -> dict:
    """{HF name: tensor} (legacy or in-memory names; experts per expert or fused) -> {Megatron state-dict name:
    tensor}, e.g. `language_model.decoder.layers.3.self_attention.linear_qkv.weight`. Refuses unknown and missing
    names."""
    from mm_adaptor.convert.rules import to_mcore

    hf = {family.canonical_hf(name): tensor for name, tensor in hf_tensors.items()}
    fused = [name for name in hf if name in family.fused_index()]
    if fused:
        major = fused_layout_major(family)
        for name in fused:
            hf.update(split_fused(family, name, hf.pop(name), major))
    check_names(family, hf)
    out = {}
    for rule in family.rules:
        for layer in family.layers(rule):
            out[rule.mcore_name(layer)] = to_mcore(rule, [hf[name] for name in rule.hf_names(layer)])
    return out


def fuse(family, hf_tensors: dict, major: int, names=None) -> dict:
    """{HF name: tensor} with experts per expert -> the same with each layer's experts fused as transformers
    `major` holds them (or only the fused tensors `names`); per-expert tensors that no fused tensor takes in whole
    stay as they are."""
    from mm_adaptor.convert.rules import fuse_experts

    out, index = dict(hf_tensors), family.fused_index()
    for name in index if names is None else names:
        fused, held = index[name]
        if all(part in out for part in held):
            parts, n = [out.pop(part) for part in held], len(fused.parts)
            out[name] = fuse_experts([parts[k:k + n] for k in range(0, len(parts), n)], major)
    return out


def mcore_to_hf_tensors(family, mcore_tensors: dict, fused_major: int | None = None) -> dict:
    """{Megatron state-dict name: tensor} -> {HF name as save_pretrained writes it: tensor}; experts one tensor set
    per expert, or with `fused_major` fused in the layout of that transformers major version."""
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
    return out if fused_major is None else fuse(family, out, fused_major)
