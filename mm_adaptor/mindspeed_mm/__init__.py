"""MindSpeed-MM users' commands: their Qwen2.5-VL fine-tuning script's arguments (arguments.py), its --mm-model
model.json (model_json.py) and --mm-data data.json (data_json.py) turned into Megatron-LM's and the trainer's
arguments before any rank starts. docs/mindspeed-mm.md is the migration page. Imports neither torch nor megatron."""

from __future__ import annotations

import os
from pathlib import Path

from mm_adaptor.mindspeed_mm import arguments, data_json, model_json


# Megatron-LM's parser defaults that command_problems compares the command's values with
MEGATRON_DEFAULTS = {"vocab_size": None, "seq_length": None, "normalization": "LayerNorm"}


def apply_to_trainer(args) -> list[str]:
    """Translate their arguments in `args` (Megatron-LM's namespace) in place, once: returns the notes to print
    (one line each), none on a second call. Raises ValueError with one line per problem."""
    if getattr(args, "mindspeed_mm_applied", False):
        return []
    problems, notes = arguments.translate(args)
    try:
        if args.mm_model:
            found, model_notes = _apply_model(args, MEGATRON_DEFAULTS)
            problems, notes = problems + found, notes + model_notes
        if args.mm_data:
            notes += data_json.apply(args, args.mm_data)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        raise ValueError("\n".join(problems))
    args.mindspeed_mm_applied = True
    return notes


def _apply_model(args, defaults: dict) -> tuple[list[str], list[str]]:
    """(problems, notes) of the model.json; sets the model's flags."""
    path = args.mm_model
    model = model_json.read(path)
    notes = model_json.field_notes(model, path)
    config = model_json.hf_config(model)
    if args.model not in ("gpt", "qwen2_5_vl"):
        return [f"--model {args.model} and --mm-model {path} (Qwen2.5-VL): give one"], notes
    problems = model_json.command_problems(model, args, path, defaults)
    problems += _checkpoint_problems(config, path, args.load)
    args.model, args.hf_config = "qwen2_5_vl", config
    return problems, notes


def _checkpoint_problems(config: dict, path: str, load: str | None) -> list[str]:
    """--load's model against the model.json's: its hf/config.json (hf-to-mcore, a --save), or the tensor shapes
    of mm-convert's layout (read memory-mapped, no weights loaded)."""
    from mm_adaptor.convert.mindspeed_mm import is_mm_checkpoint

    if not load:
        return []
    if (Path(load) / "hf" / "config.json").is_file():
        from mm_adaptor.models import registry

        problem = model_json.checkpoint_problem(config, registry.hf_config_of(load), path, load)
        return [problem] if problem else []
    if is_mm_checkpoint(load):
        from mm_adaptor.convert import ConvertError
        from mm_adaptor.convert.mindspeed_mm import check_mm_checkpoint

        try:
            check_mm_checkpoint(load, config)
        except ConvertError as exc:
            return [f"--mm-model {path} contradicts --load {exc}"]
    return []


def print_notes(notes: list[str]) -> None:
    """On rank 0 only (under torchrun every rank translates the same command)."""
    if os.environ.get("RANK", "0") in ("", "0"):
        for note in notes:
            print(f"mm-adaptor train: {note}", flush=True)
