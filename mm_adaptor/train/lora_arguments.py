"""The trainer's LoRA flags (MindSpeed-MM's names and defaults), where a run's base comes from, and what a resume
must keep (mm_adaptor.lora builds the adapters)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mm_adaptor.convert.mcore_io import INFO, MARKER, saved_arguments

GROUP = "mm_adaptor trainer: LoRA fine-tuning (MindSpeed-MM's flags, not Megatron-LM's)"
# what a resume must have as the save had it (a changed alpha would load and silently rescale the adapters)
SETTINGS = ("lora_target_modules", "lora_r", "lora_alpha")


def add_arguments(add) -> None:
    add("--lora-target-modules", nargs="+", default=[], metavar="NAME",
        help="train LoRA adapters on these linears, the base frozen: a module named so or ending in .NAME (peft's "
             "rule), e.g. linear_qkv linear_proj linear_fc1 linear_fc2 (names may also be joined by commas); a "
             "frozen tower (--freeze-vision, --freeze-language) gets none")
    add("--lora-r", type=int, default=8, help="the adapters' rank (default 8)")
    add("--lora-alpha", type=float, default=16.0, help="scaling alpha / r (default 16)")
    add("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input (default 0)")
    add("--lora-register-forward-hook", nargs="*", default=None, metavar="MODULE",
        help="MindSpeed-MM's hooks that make these modules' outputs need gradients under full recompute; taken and "
             "not needed here: a LoRA run's fully recomputed blocks take hidden states that need them")
    add("--load-base-model", default=None, metavar="DIR",
        help="the base model's checkpoint (converted, or a full training save) when --load holds the adapters of a "
             "LoRA run to resume; on a first run --load may hold the base instead")


def checkpoint_kind(directory) -> str | None:
    """What a Megatron checkpoint directory holds: "adapters" (a LoRA run's save, or adapters converted from
    peft's format), "base" (a whole model), or None (no checkpoint there)."""
    path = Path(directory)
    if (path / INFO).is_file():
        return "adapters" if json.loads((path / INFO).read_text()).get("lora") else "base"
    if not (path / MARKER).is_file():
        return None
    saved = saved_arguments(directory)
    return "adapters" if getattr(saved, "lora_target_modules", None) else "base"


def problems(args, family, notes: list[str]) -> list[str]:
    """LoRA's flags (mm_adaptor.lora), and where the base comes from: --load-base-model, or on a first run --load
    holding a whole model, which then loads as the base (as MindSpeed-MM reads it) and Megatron starts afresh. What
    it says goes to `notes`."""
    from mm_adaptor import lora

    found = lora.argument_problems(args)
    if found or not lora.enabled(args):
        return found
    if args.lora_register_forward_hook is not None:
        notes.append("LoRA: --lora-register-forward-hook is not needed here (a LoRA run's fully recomputed blocks take "
                     "hidden states that need gradients): it has no effect")
    if args.load_base_model:
        if checkpoint_kind(args.load_base_model) != "base":
            return [f"--load-base-model {args.load_base_model}: no whole model's checkpoint there (converted with "
                    "mm-adaptor convert hf-to-mcore, or a full training save)"]
        return []
    kind = checkpoint_kind(args.load) if args.load else None
    if kind == "adapters":
        return [f"--load {args.load} holds LoRA adapters alone: add --load-base-model DIR, the base model they "
                "were trained on"]
    if kind == "base":
        args.load_base_model, args.load = args.load, None
        notes.append(f"LoRA: --load {args.load_base_model} holds the base model: its weights load and the adapters "
                     "start new (to resume, --load the run's --save and --load-base-model this)")
    elif hasattr(family, "model_config") and not family.tiny and not getattr(args, "hf_config", None):
        return ["LoRA trains adapters on a base model: give --load with the converted base (or --load-base-model)"]
    else:
        notes.append("LoRA: no --load-base-model, so the base is randomly initialised (a tiny model's trial run)")
    return []


def resume_problems(args) -> list[str]:
    """Adapters resumed under other targets, rank or alpha than they were trained with (one line each)."""
    from mm_adaptor import lora

    if not args.load or not lora.enabled(args) or checkpoint_kind(args.load) != "adapters":
        return []
    saved = saved_arguments(args.load)
    if saved is None:  # adapters converted from peft's format: their own rank and alpha (mm_adaptor_convert.json)
        saved = argparse.Namespace(**json.loads((Path(args.load) / INFO).read_text())["lora"])
    changed = [name for name in SETTINGS
               if getattr(saved, name, None) is not None and _value(name, getattr(saved, name))
               != _value(name, getattr(args, name))]
    return [f"--{name.replace('_', '-')} {_value(name, getattr(args, name))}: --load {args.load} holds adapters "
            f"trained with {_value(name, getattr(saved, name))}: give that" for name in changed]


def _value(name, value):
    from mm_adaptor import lora

    if name == "lora_target_modules":
        return " ".join(sorted(lora.targets_of(value)))
    return float(value) if name == "lora_alpha" else value
