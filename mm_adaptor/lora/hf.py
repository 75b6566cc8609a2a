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


def _held(family: Family) -> frozenset[str]:
    """transformers' parameter names, and its fused experts' names with `.weight` (as the rules name weights)."""
    return transformers_names(family.config) | {f"{name}.weight" for name in transformers_names(family.config)
                                                if name.endswith(("gate_up_proj", "down_proj"))}


def in_memory_name(family: Family, name: str, layer: int | None = 0) -> str:
    """An HF name as the family's rules write it (`{i}` for a layer) -> the name transformers' model holds it under
    in memory, which peft's keys use: the rules' own, or one of the family's alias prefixes in its place (whichever
    the installed transformers' model has)."""
    held = _held(family)
    probe = name.replace("{i}", str(layer or 0)).replace("{e}", "0")
    if probe in held:
        return name
    for new, old in family.hf_aliases.items():
        if name.startswith(old) and new + probe[len(old):] in held:
            return new + name[len(old):]
    raise ValueError(f"{probe}: transformers' {family.config.get('model_type')} model holds no such parameter")


# an expert's part in transformers' fused experts tensors (which peft adapts as parameters: target_parameters)
EXPERT_PART = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+|\{e\})\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")
FUSED_OF = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
PEFT_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\."
                         r"(?P<factor>lora_A|lora_B)\.weight$")


def peft_key(family: Family, hf_weight: str, factor: str, layer: int | None = 0) -> str:
    """`model.layers.0.self_attn.q_proj.weight` -> `base_model.model.model.language_model.layers.0.self_attn.q_proj.
    lora_A.weight` (Qwen2.5-VL). An expert's part keeps its per-expert name here (`...experts.3.gate_proj.lora_A.
    weight`); fuse_experts puts the experts of a layer into peft's layout."""
    found = EXPERT_PART.match(hf_weight)
    if found:
        fused = in_memory_name(family, f"{found['prefix']}.{FUSED_OF[found['part']]}.weight", layer)[
            :-len(".weight")]
        prefix = fused.rsplit(".", 1)[0]
        return f"{PEFT_PREFIX}{prefix}.{found['e']}.{found['part']}.{factor}.weight"
    module = in_memory_name(family, hf_weight, layer)[:-len(".weight")]
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
        probe = family.layers(rule)[0]  # a layer the rule covers (a MoE model's dense MLPs: some only)
        for factor, op in ((LORA_A, ADAPTABLE_OPS[rule.op]), (LORA_B, rule.op)):
            rules.append(replace(rule, mcore=f"{module}.{factor}.weight",
                                 hf=tuple(peft_key(family, name, factor, probe) for name in rule.hf), op=op))
    return rules


def adapter_family(family: Family, keep=None) -> Family:
    """The family whose rules are its adapters' (those `keep(rule)` accepts): names, stacks and layers as the base's;
    HF names already peft's, an expert's per expert (fuse_experts puts them in peft's layout), no aliases."""
    rules = [rule for rule in adapter_rules(family) if keep is None or keep(rule)]
    return Family(name=f"{family.name}-lora", rules=rules, stacks=dict(family.stacks), subsets=dict(family.subsets),
                  per_layer_keys=family.per_layer_keys, config=family.config, fused_experts=())


def _expert_keys(prefix: str, parts: set[str]) -> dict[str, str]:
    """The peft key of each fused experts parameter adapted at `prefix` (`...mlp.experts`): with both, gate_up_proj's
    wrapper sits inside down_proj's (`experts.base_layer.lora_A.weight`), peft's nesting; alone, either is
    `experts.lora_A.weight`."""
    both = parts == {"gate_up_proj", "down_proj"}
    return {fused: f"{prefix}.base_layer" if both and fused == "gate_up_proj" else prefix for fused in parts}


def require_transformers_5_experts() -> None:
    """peft's expert adapters here follow transformers 5's fused experts (E, out, in); 4.x stores them transposed."""
    from mm_adaptor.convert import installed_transformers_major

    major = installed_transformers_major()
    if major is not None and major < 5:
        raise ValueError(f"adapters on MoE experts go to and from peft's format for transformers 5's fused experts "
                         f"(E, out, in); the installed transformers {major}.x stores them transposed: install "
                         "transformers 5 for this conversion")


def fuse_experts(tensors: dict, experts: int) -> dict:
    """Per-expert adapters (`...experts.<e>.gate_proj.lora_A.weight`, ...) -> peft's adapters of transformers' fused
    experts parameters: per layer and parameter, A [E r, in] with expert e's rows e r .. (e + 1) r, and B [out, E r]
    with expert e's columns e, e + E, ... (peft's ParamWrapper). gate and up share A and stack their B rows."""
    import torch

    grouped: dict[tuple[str, str], dict] = {}
    out = {}
    for name, tensor in tensors.items():
        found = PEFT_EXPERT.match(name)
        if not found:
            out[name] = tensor
            continue
        grouped.setdefault((found["prefix"], FUSED_OF[found["part"]]), {})[
            int(found["e"]), found["part"], found["factor"]] = tensor
    by_prefix: dict[str, set[str]] = {}
    for prefix, fused in grouped:
        by_prefix.setdefault(prefix, set()).add(fused)
    for (prefix, fused), parts in grouped.items():
        key = _expert_keys(prefix, by_prefix[prefix])[fused]
        names = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
        a = [parts[e, names[0], "lora_A"] for e in range(experts)]
        b = [torch.cat([parts[e, part, "lora_B"] for part in names]) for e in range(experts)]
        out[f"{key}.lora_A.weight"] = torch.cat(a).contiguous()
        out[f"{key}.lora_B.weight"] = torch.stack(b, dim=2).reshape(b[0].shape[0], -1).contiguous()
    return out


def split_experts(tensors: dict, family: Family, parameters=()) -> dict:
    """The inverse of fuse_experts for the fused experts parameters adapter_config.json's target_parameters name
    (which one a single wrapper's `experts.lora_A.weight` is)."""
    adapted = {name.rsplit(".", 1)[-1] for name in parameters or ()}
    if not adapted:
        return dict(tensors)
    require_transformers_5_experts()
    experts, prefixes = family.num_experts, set()
    for rule in family.rules:
        for layer in family.layers(rule):
            for name in rule.hf_names(layer):
                if EXPERT_PART.match(name):
                    prefixes.add(peft_key(family, name, "lora_A", layer).rsplit(".", 4)[0])
    out = dict(tensors)
    for prefix in sorted(prefixes):
        for fused, key in _expert_keys(prefix, adapted).items():
            if f"{key}.lora_A.weight" not in out:
                continue
            a, b = out.pop(f"{key}.lora_A.weight"), out.pop(f"{key}.lora_B.weight")
            r = a.shape[0] // experts
            names = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
            rows = b.shape[0] // len(names)
            for e in range(experts):
                b_e = b[:, e::experts]
                for k, part in enumerate(names):
                    out[f"{prefix}.{e}.{part}.lora_A.weight"] = a[e * r:(e + 1) * r].contiguous()
                    out[f"{prefix}.{e}.{part}.lora_B.weight"] = b_e[k * rows:(k + 1) * rows].contiguous()
    return out


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


def peft_targets(keys) -> tuple[set[str], list[str]]:
    """(the HF linears, the fused experts parameters) that per-expert peft keys (before fuse_experts) adapt."""
    parameters = sorted({f"mlp.experts.{FUSED_OF[found['part']]}" for name in keys
                         for found in [PEFT_EXPERT.match(name)] if found})
    if parameters:
        require_transformers_5_experts()
    return {module_of(name) for name in keys if not PEFT_EXPERT.match(name)}, parameters


def write_config(out: Path, family: Family, targets: tuple[set[str], list[str]], r: int, alpha: float,
                 dropout: float) -> None:
    """adapter_config.json as peft writes it (its own LoraConfig, so that every field is the installed peft's):
    target_modules for the linears, target_parameters for transformers' fused experts (peft_targets)."""
    from peft import LoraConfig

    modules, parameters = targets
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, bias="none",
                        target_modules=target_modules(family, modules) if modules else None,
                        target_parameters=parameters or None)
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
    linear_qkv.lora_A.weight`) -> peft's keys and tensors, for the adapters present (experts fused as peft
    holds them)."""
    return fuse_experts(per_expert_peft(family, tensors), family.num_experts)


def per_expert_peft(family: Family, tensors: dict) -> dict:
    """to_peft before the experts are fused into peft's layout (peft_targets reads these keys)."""
    from mm_adaptor.convert.rules import to_hf

    out = {}
    for rule in adapter_family(family).rules:
        for layer in family.layers(rule):
            name = rule.mcore_name(layer)
            if name in tensors:
                out.update(zip(rule.hf_names(layer), to_hf(rule, tensors[name])))
    return out


def from_peft(family: Family, tensors: dict, parameters=()) -> dict:
    """The inverse of to_peft (`parameters`: adapter_config.json's target_parameters, the fused experts adapted);
    ValueError names a key no rule has, or a fused module's parts missing or unequal."""
    from mm_adaptor.convert.rules import to_mcore

    index = adapter_family(family).hf_index()
    tensors = split_experts(tensors, family, parameters)
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
