"""Adapters in Hugging Face PEFT's format: the converter's rules (mm_adaptor.convert.rules) for the LoRA factors of a
family's linears, whose HF names are the keys peft saves for transformers' model
(`base_model.model.<module>.lora_A.weight`, `<module>` as transformers names it in memory).

A Megatron linear's adapter (A [r, in], B [out, r]) against HF's modules, exact both ways at the same rank:
- one HF linear (o_proj, down_proj, a vision block's fused qkv): A as it is, B's rows as the base weight's rows
  (the fused qkv's regrouped per head as its weight is);
- several HF linears fused into one (q/k/v into linear_qkv, gate/up into linear_fc1): every part shares A, and B's
  rows split as the base weight's do. Back from HF, the parts' A must be equal (an adapter this export wrote, or
  one trained so); separate ones are refused, naming the module."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from mm_adaptor.convert.rules import Family, Rule
from mm_adaptor.lora.layers import LORA_A, LORA_B

PEFT_PREFIX = "base_model.model."
CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
ADAPTABLE_OPS = {"copy": "copy", "qkv_fused": "copy", "qkv": "shared", "cat": "shared"}  # base op -> A's op


def transformers_names(config: dict) -> frozenset[str]:
    """The parameter names of transformers' model of an HF config, as it holds them in memory (built on the meta
    device: no memory, any size)."""
    key = json.dumps(config, sort_keys=True, default=str)
    if key not in _NAMES:
        import torch
        import transformers

        settings = {k: v for k, v in config.items() if k != "model_type"}
        hf_config = transformers.AutoConfig.for_model(config["model_type"], **settings)
        with torch.device("meta"):
            model = transformers.AutoModelForImageTextToText.from_config(hf_config)
        _NAMES[key] = frozenset(name for name, _ in model.named_parameters())
    return _NAMES[key]


_NAMES: dict[str, frozenset[str]] = {}


def in_memory_name(family: Family, name: str) -> str:
    """An HF name as the family's rules write it (`{i}` for a layer) -> the name transformers' model holds it under
    in memory, which peft's keys use: the rules' own, or one of the family's alias prefixes in its place (whichever
    the installed transformers' model has)."""
    held = transformers_names(family.config)
    probe = name.replace("{i}", "0").replace("{e}", "0")
    if probe in held:
        return name
    for new, old in family.hf_aliases.items():
        if name.startswith(old) and new + probe[len(old):] in held:
            return new + name[len(old):]
    raise ValueError(f"{probe}: transformers' {family.config.get('model_type')} model holds no such parameter")


def peft_key(family: Family, hf_weight: str, factor: str) -> str:
    """`model.layers.0.self_attn.q_proj.weight` -> `base_model.model.model.language_model.layers.0.self_attn.q_proj.
    lora_A.weight` (Qwen2.5-VL)."""
    module = in_memory_name(family, hf_weight)[:-len(".weight")]
    return f"{PEFT_PREFIX}{module}.{factor}.weight"


def adapter_rules(family: Family) -> list[Rule]:
    """The factors' rules of every linear weight the family maps: its A, then its B."""
    rules = []
    for rule in family.rules:
        if rule.op not in ADAPTABLE_OPS or not rule.mcore.endswith(".weight") or rule.mcore.endswith("router.weight"):
            continue
        module = rule.mcore[:-len(".weight")]
        if not module.rsplit(".", 1)[-1].startswith("linear_"):
            continue
        for factor, op in ((LORA_A, ADAPTABLE_OPS[rule.op]), (LORA_B, rule.op)):
            rules.append(replace(rule, mcore=f"{module}.{factor}.weight",
                                 hf=tuple(peft_key(family, name, factor) for name in rule.hf), op=op))
    return rules


def adapter_family(family: Family, keep=None) -> Family:
    """The family whose rules are its adapters' (those `keep(rule)` accepts): names, stacks and layers as the base's;
    HF names already peft's (no aliases); no experts fused (expert adapters are not built yet)."""
    rules = [rule for rule in adapter_rules(family) if keep is None or keep(rule)]
    return Family(name=f"{family.name}-lora", rules=rules, stacks=dict(family.stacks), subsets=dict(family.subsets),
                  per_layer_keys=family.per_layer_keys, config=family.config, fused_experts=())


def module_of(peft_name: str) -> str:
    """`base_model.model.X.lora_A.weight` -> `X` (the HF module transformers names X)."""
    return peft_name[len(PEFT_PREFIX):].rsplit(".", 2)[0]


def target_modules(family: Family, adapted: set[str]):
    """adapter_config.json's target_modules: the adapted modules' last names where peft's suffix match over the
    base's modules selects exactly them (what users and serving engines expect), else a regular expression that
    peft full-matches to exactly them."""
    every = {name[:-len(".weight")] for name in transformers_names(family.config) if name.endswith(".weight")}
    leaves = sorted({name.rsplit(".", 1)[-1] for name in adapted})
    if {name for name in every if name.rsplit(".", 1)[-1] in leaves} == adapted:
        return leaves
    patterns = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name)) for name in adapted})
    pattern = "|".join(patterns)
    if {name for name in every if re.fullmatch(pattern, name)} == adapted:
        return f"(?:{pattern})"
    return "(?:" + "|".join(sorted(re.escape(name) for name in adapted)) + ")"


def write_config(out: Path, family: Family, adapted: set[str], r: int, alpha: float, dropout: float) -> None:
    """adapter_config.json as peft writes it (its own LoraConfig, so that every field is the installed peft's)."""
    from peft import LoraConfig

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules(family, adapted),
                        bias="none")
    config.save_pretrained(str(out))


def read_config(adapter_dir: Path) -> dict:
    """adapter_config.json, with what this converter does not take refused (ValueError, one line)."""
    path = adapter_dir / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{adapter_dir}: no {CONFIG_NAME} (a peft adapter directory holds it)")
    config = json.loads(path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config['peft_type']}: only LORA adapters are taken")
    for key in ("use_dora", "use_rslora", "lora_bias", "rank_pattern", "alpha_pattern", "modules_to_save",
                "target_parameters"):
        if config.get(key):
            raise ValueError(f"{path}: {key} {config[key]!r} is not taken here (plain LoRA adapters: one rank and "
                             "alpha, no extra trained modules)")
    return config


def to_peft(family: Family, tensors: dict) -> dict:
    """Whole adapter tensors under the Megatron model's names (TP 1, one stage: `...layers.0.self_attention.
    linear_qkv.lora_A.weight`) -> peft's keys and tensors, for the adapters present."""
    from mm_adaptor.convert.rules import to_hf

    out = {}
    for rule in adapter_family(family).rules:
        for layer in family.layers(rule):
            name = rule.mcore_name(layer)
            if name in tensors:
                out.update(zip(rule.hf_names(layer), to_hf(rule, tensors[name])))
    return out


def from_peft(family: Family, tensors: dict) -> dict:
    """The inverse of to_peft; ValueError names a key no rule has, or a fused module's parts missing or unequal."""
    from mm_adaptor.convert.rules import to_mcore

    index = adapter_family(family).hf_index()
    unknown = sorted(set(tensors) - set(index))
    if unknown:
        raise ValueError(f"{unknown[0]}: no linear of the {family.name} model is adapted under that name")
    grouped: dict[tuple, dict] = {}
    for name, tensor in tensors.items():
        rule, layer, position = index[name]
        grouped.setdefault((rule, layer), {})[position] = tensor
    out = {}
    for (rule, layer), parts in grouped.items():
        if len(parts) != len(rule.hf):
            absent = [name for i, name in enumerate(rule.hf_names(layer)) if i not in parts]
            raise ValueError(f"{absent[0]}: missing, and {rule.mcore_name(layer)} needs all of "
                             f"{', '.join(rule.hf_names(layer))}")
        out[rule.mcore_name(layer)] = to_mcore(rule, [parts[i] for i in range(len(rule.hf))])
    return out
