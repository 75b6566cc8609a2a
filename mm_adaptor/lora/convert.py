"""`mm-adaptor convert lora-to-hf` and `hf-to-mcore --lora`: a LoRA run's adapters (a Megatron dist checkpoint of the
adapters alone, any TP/PP layout) <-> peft's adapter directory (adapter_config.json + adapter_model.safetensors
under the keys peft gives transformers' model). Both refuse in one line (ConvertError) before writing."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from mm_adaptor.convert import ConvertError
from mm_adaptor.convert.hf_to_mcore import read_config, require_empty
from mm_adaptor.convert.mcore_io import INFO, ITER_DIR, MARKER
from mm_adaptor.lora import hf as lora_hf
from mm_adaptor.lora.layers import LORA_A, is_adapter_key


def _family(config_path: Path):
    from mm_adaptor.convert.families import checkpoint_family

    try:
        return checkpoint_family(read_config(config_path))
    except (KeyError, ValueError) as error:
        raise ConvertError(f"{config_path}: {error}") from None


def _settings(mcore_dir: Path, checkpoint: Path) -> dict:
    """The adapters' alpha and dropout: their training run's arguments (the checkpoint's common state), or a
    conversion's record (mm_adaptor_convert.json)."""
    if (mcore_dir / INFO).is_file():
        lora = json.loads((mcore_dir / INFO).read_text()).get("lora")
        if lora:
            return lora
    from megatron.core import dist_checkpointing

    args = dist_checkpointing.load_common_state_dict(str(checkpoint)).get("args")
    if args is None or not getattr(args, "lora_target_modules", None):
        raise ConvertError(f"{mcore_dir}: not a LoRA run's checkpoint (its arguments name no --lora-target-modules)")
    return {"lora_alpha": args.lora_alpha, "lora_dropout": args.lora_dropout, "lora_r": args.lora_r,
            "load_base_model": getattr(args, "load_base_model", None)}


def _require_peft() -> None:
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConvertError("peft is not installed: it writes the adapter's config (pip install 'mm-adaptor[lora]', "
                           "or peft)")


def lora_to_hf(mcore_dir, out, hf_config=None) -> dict:
    """A LoRA run's --save (its latest iteration) -> peft's adapter directory for transformers' model."""
    _require_peft()
    from safetensors.torch import save_file

    from mm_adaptor.convert.mcore_to_hf import _torch_format_problem, checkpoint_path
    from mm_adaptor.convert.mcore_io import Reader
    from mm_adaptor.convert.rules import to_hf

    start = time.time()
    mcore_dir, out = Path(mcore_dir), Path(out)
    require_empty(out)
    config_path = Path(hf_config) if hf_config else mcore_dir / "hf" / "config.json"
    family = _family(config_path)
    path = checkpoint_path(mcore_dir)
    problem = _torch_format_problem(path)
    if problem:
        raise ConvertError(problem)
    settings = _settings(mcore_dir, path)
    reader = Reader(path)
    stored = reader.tensors()
    adapters = {key for key in stored if is_adapter_key(key) and not key.startswith("optimizer.")}
    if not adapters:
        raise ConvertError(f"{path}: no adapter tensors (lora_A / lora_B) in the checkpoint")
    whole = lora_hf.adapter_family(family)
    family_keys = {family.placement(rule, layer)[0] for rule in whole.rules for layer in whole.layers(rule)}
    unknown = sorted(adapters - family_keys)
    if unknown:
        raise ConvertError(f"{unknown[0]}: the {family.name} mapping has no linear under that name")
    chosen = lora_hf.adapter_family(family, keep=lambda rule: family.placement(rule, family.layers(rule)[0])[0]
                                    in adapters)
    tensors, ranks = {}, set()
    for rule in chosen.rules:
        for layer in chosen.layers(rule):
            key, offsets, _ = chosen.placement(rule, layer)
            tensor = reader.read(key, offsets)
            if rule.mcore.endswith(f"{LORA_A}.weight"):
                ranks.add(tensor.shape[0])
            tensors.update(zip(rule.hf_names(layer), to_hf(rule, tensor)))
    if len(ranks) != 1:
        raise ConvertError(f"{path}: adapters of ranks {sorted(ranks)}; peft's config holds one")
    try:
        targets = lora_hf.peft_targets(tensors)
    except ValueError as error:
        raise ConvertError(str(error)) from None
    tensors = lora_hf.fuse_experts(tensors, family.num_experts)
    out.mkdir(parents=True, exist_ok=True)
    try:
        save_file(tensors, str(out / lora_hf.WEIGHTS_NAME), metadata={"format": "pt"})
        lora_hf.write_config(out, family, targets, ranks.pop(), settings["lora_alpha"],
                             settings.get("lora_dropout", 0.0))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"seconds": time.time() - start, "tensors": len(tensors), "bytes": nbytes}


def base_config(base_dir: Path) -> Path:
    """The base model's config.json: an HF directory's own, or a converted checkpoint's hf/."""
    for path in (base_dir / "config.json", base_dir / "hf" / "config.json"):
        if path.is_file():
            return path
    raise ConvertError(f"{base_dir}: no config.json (an HF model directory) and no hf/config.json (a converted "
                       "checkpoint): give the base model the adapter was trained on")


def hf_to_mcore(adapter_dir, base_dir, out) -> dict:
    """peft's adapter directory for the model under BASE_DIR (its HF directory, or the converted checkpoint) -> a
    Megatron dist checkpoint of the adapters alone, which the trainer takes with --load OUT --load-base-model
    <the converted base> (as a converted checkpoint: iteration 0, a new optimizer)."""
    from safetensors.torch import load_file

    from mm_adaptor.convert.mcore_io import PieceWriter, single_process_group

    start = time.time()
    adapter_dir, base_dir, out = Path(adapter_dir), Path(base_dir), Path(out)
    require_empty(out)
    family = _family(base_config(base_dir))
    try:
        config = lora_hf.read_config(adapter_dir)
    except ValueError as error:
        raise ConvertError(str(error)) from None
    weights = adapter_dir / lora_hf.WEIGHTS_NAME
    if not weights.is_file():
        raise ConvertError(f"{adapter_dir}: no {lora_hf.WEIGHTS_NAME}")
    peft_tensors = {name.replace(".default.", "."): tensor for name, tensor in load_file(str(weights)).items()}
    try:
        tensors = lora_hf.from_peft(family, peft_tensors, config.get("target_parameters"))
    except ValueError as error:
        raise ConvertError(f"{weights}: {error}") from None
    ranks = {tensor.shape[0] for name, tensor in tensors.items() if name.endswith(f"{LORA_A}.weight")}
    if ranks != {config["r"]}:
        raise ConvertError(f"{weights}: A factors of rank {sorted(ranks)}, its config says r {config['r']}")
    chosen = lora_hf.adapter_family(family)
    placements = []
    for rule in chosen.rules:
        for layer in chosen.layers(rule):
            name = rule.mcore_name(layer)
            if name in tensors:
                key, offsets, totals = chosen.placement(rule, layer)
                placements.append((key, tensors[name].contiguous(), offsets, totals))
    targets = sorted({name.rsplit(".", 2)[0].rsplit(".", 1)[-1] for name in tensors})  # linear_qkv, ...
    lora = {"lora_target_modules": targets, "lora_r": config["r"], "lora_alpha": float(config["lora_alpha"]),
            "lora_dropout": float(config.get("lora_dropout") or 0.0)}
    out.mkdir(parents=True, exist_ok=True)
    try:
        with single_process_group():
            writer = PieceWriter(out / ".staging")
            writer.save(placements, [], {"mm_adaptor_convert": {"family": family.name, "lora": lora}})
            writer.finish(out / ITER_DIR)
        (out / MARKER).write_text("0")
        (out / INFO).write_text(json.dumps({"family": family.name, "lora": lora, "source": str(adapter_dir),
                                            "base": str(base_dir), "tensors": len(placements)}, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    nbytes = sum(tensor.numel() * tensor.element_size() for _, tensor, _, _ in placements)
    return {"seconds": time.time() - start, "tensors": len(placements), "bytes": nbytes}


class _Merged:
    """A base checkpoint's Reader with each adapted weight read as W + alpha / r * B @ A (the adapter's factors at
    the same key and offsets: Megatron's fused rows, so one product serves every HF part), in float32."""

    def __init__(self, base, adapters, scaling: float):
        self.base, self.adapters, self.scaling = base, adapters, scaling
        self.adapted = {key[:-len(f"{LORA_A}.weight")] for key in adapters.tensors()
                        if key.endswith(f"{LORA_A}.weight") and not key.startswith("optimizer.")}
        self.merged: set[str] = set()

    def tensors(self):
        return self.base.tensors()

    def read(self, key: str, index=()):

        weight = self.base.read(key, index)
        module = key[:-len("weight")]
        if not key.endswith(".weight") or module not in self.adapted:
            return weight
        a = self.adapters.read(f"{module}{LORA_A}.weight", index).float()
        b = self.adapters.read(f"{module}lora_B.weight", index).float()
        self.merged.add(module)
        return (weight.float() + (b @ a) * self.scaling).to(weight.dtype)


def merge(lora_dir, out, base_dir=None, hf_config=None, max_shard_bytes: int = 5 * 10**9) -> dict:
    """A LoRA run's --save merged into its base: a whole HF checkpoint (the weights W + alpha / r * B @ A, what
    peft's merge_and_unload gives) that transformers loads like any other. The base: --base, else the run's
    --load-base-model."""
    from mm_adaptor.convert.mcore_io import Reader
    from mm_adaptor.convert.mcore_to_hf import _write, checkpoint_path, plan

    lora_dir, out = Path(lora_dir), Path(out)
    require_empty(out)
    adapters_path = checkpoint_path(lora_dir)
    settings = _settings(lora_dir, adapters_path)
    base = base_dir or settings.get("load_base_model")
    if not base:
        raise ConvertError(f"{lora_dir}: its run names no --load-base-model: give --base BASE_DIR")
    base = Path(base)
    config = Path(hf_config) if hf_config else (lora_dir / "hf" / "config.json"
                                                 if (lora_dir / "hf" / "config.json").is_file() else None)
    family, reader, units, major = plan(base, config)
    adapters = Reader(adapters_path)
    ranks = {shape[-2] for key, (shape, _) in adapters.tensors().items()
             if key.endswith(f"{LORA_A}.weight") and not key.startswith("optimizer.")}
    if len(ranks) != 1:
        raise ConvertError(f"{adapters_path}: no adapters, or adapters of several ranks {sorted(ranks)}")
    merged = _Merged(reader, adapters, settings["lora_alpha"] / ranks.pop())
    unknown = sorted(merged.adapted - {key[:-len("weight")] for key in reader.tensors()})
    if unknown:
        raise ConvertError(f"{unknown[0]}lora_A.weight: the base {base} has no such weight")
    try:
        figures = _write(family, merged, units, major, base, out, hf_config, max_shard_bytes)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    if merged.merged != merged.adapted:
        shutil.rmtree(out, ignore_errors=True)
        missed = sorted(merged.adapted - merged.merged)
        raise ConvertError(f"{missed[0]}weight: adapted but not written (no HF tensor takes it)")
    return {**figures, "merged": len(merged.merged)}
