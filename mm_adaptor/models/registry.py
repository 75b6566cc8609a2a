"""The model families that the driver and the tools (train, check, convert, generate) know: one spec per family.

A spec names where each of the family's pieces lives (imported on use, so that reading the registry imports
neither torch nor megatron):
- its model package (vision-language families): `config_from_hf` (the config reader), `tiny_config` (the tiny
  preset, with the spec's `tiny` keywords), `tiny_hf_config_dict`, `model_provider`, `rope_index_for`;
- its conversion rules (`mapping`: `family(cfg)` and `dims(cfg)`);
- its driver hooks (`driver`: the batch builder, the forward step and the parallel constraints, in
  mm_adaptor/train/families.py and vlm.py).

A run names its family with `--model NAME` or `--model NAME-tiny`; a converted directory names it in its
hf/config.json's `model_type`."""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

TINY = "-tiny"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    summary: str
    driver: str  # "module:Class" of the driver hooks
    package: str | None = None
    mapping: str | None = None
    hf_model_types: tuple[str, ...] = ()
    tiny: dict = field(default_factory=dict)  # keywords of the package's tiny_config for NAME-tiny
    has_tiny: bool = False

    def package_module(self):
        if self.package is None:
            raise ValueError(f"--model {self.name} has no model package")
        return importlib.import_module(self.package)

    def mapping_module(self):
        if self.mapping is None:
            raise ValueError(f"model family {self.name} has no conversion rules")
        return importlib.import_module(self.mapping)

    def config_from_hf(self, hf_config: dict, **layout):
        return self.package_module().config_from_hf(hf_config, **layout)

    def tiny_config(self, **layout):
        return self.package_module().tiny_config(**self.tiny, **layout)

    def driver_hooks(self):
        module, name = self.driver.split(":")
        return getattr(importlib.import_module(module), name)(self)


_VLM = "mm_adaptor.train.vlm:VisionLanguage"
SPECS = {spec.name: spec for spec in (
    ModelSpec("gpt", "the tiny GPT on megatron-core's local spec (mock data)", "mm_adaptor.train.families:Gpt"),
    ModelSpec("hybrid", "megatron-core's HybridModel from --hybrid-layer-pattern (mock data)",
              "mm_adaptor.train.families:Hybrid"),
    ModelSpec("qwen2_5_vl", "Qwen2.5-VL", _VLM, "mm_adaptor.models.qwen2_5_vl", "mm_adaptor.models.qwen2_5_vl.mapping",
              ("qwen2_5_vl",), has_tiny=True),
    ModelSpec("qwen3_vl", "Qwen3-VL (dense)", _VLM, "mm_adaptor.models.qwen3_vl", "mm_adaptor.models.qwen3_vl.mapping",
              ("qwen3_vl",), {"moe": False}, has_tiny=True),
    ModelSpec("qwen3_vl_moe", "Qwen3-VL-MoE", _VLM, "mm_adaptor.models.qwen3_vl",
              "mm_adaptor.models.qwen3_vl.mapping", ("qwen3_vl_moe",), {"moe": True}, has_tiny=True),
    ModelSpec("internvl", "InternVL (InternViT + Qwen2/Qwen3; native and OpenGVLab checkpoints)", _VLM,
              "mm_adaptor.models.internvl", "mm_adaptor.models.internvl.mapping", ("internvl", "internvl_chat"),
              has_tiny=True),
)}


def model_choices() -> list[str]:
    """What --model accepts: every family's name, and NAME-tiny where it has a tiny preset."""
    return [choice for spec in SPECS.values() for choice in (spec.name, *([spec.name + TINY] if spec.has_tiny else []))]


def resolve(model: str) -> tuple[ModelSpec, bool]:
    """(spec, tiny) of a --model value."""
    tiny = model.endswith(TINY)
    name = model[: -len(TINY)] if tiny else model
    if name not in SPECS or (tiny and not SPECS[name].has_tiny):
        raise ValueError(f"--model {model}: unknown (choose from {', '.join(model_choices())})")
    return SPECS[name], tiny


def spec_for_hf_config(hf_config: dict) -> ModelSpec:
    """The family whose checkpoints carry this config.json (its model_type); ValueError names an unknown one."""
    model_type = hf_config.get("model_type")
    for spec in SPECS.values():
        if model_type in spec.hf_model_types:
            return spec
    known = ", ".join(t for spec in SPECS.values() for t in spec.hf_model_types)
    raise ValueError(f"model_type {model_type!r} is not a family this adaptor builds (known: {known})")


@functools.lru_cache(maxsize=8)
def _read_json(path: str, mtime_ns: int) -> str:
    return Path(path).read_text()


def hf_config_of(directory) -> dict:
    """DIR/hf/config.json of a converted checkpoint or a training --save, read once per process (while unchanged)."""
    path = Path(directory) / "hf" / "config.json"
    return json.loads(_read_json(str(path), path.stat().st_mtime_ns))


def spec_for_directory(directory) -> ModelSpec:
    return spec_for_hf_config(hf_config_of(directory))
