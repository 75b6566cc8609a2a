"""Megatron dist checkpoint -> HF directory (sharded safetensors + index, config, tokenizer/processor files),
reading one output shard's tensors at a time."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from mm_adaptor.convert import ConvertError, family_for
from mm_adaptor.convert.hf_to_mcore import INDEX, copy_side_files, progress, read_config, require_empty
from mm_adaptor.convert.mcore_io import ITER_DIR, MARKER, Reader

PREFIXES = ("vision_model.", "vision_projection.", "language_model.")


def checkpoint_path(mcore_dir: Path) -> Path:
    """The dist checkpoint under MCORE_DIR: the one its marker names, or MCORE_DIR itself."""
    marker = mcore_dir / MARKER
    if marker.exists():
        text = marker.read_text().strip()
        return mcore_dir / (f"iter_{int(text):07d}" if text.isdigit() else text)
    if (mcore_dir / ".metadata").exists():
        return mcore_dir
    if (mcore_dir / ITER_DIR / ".metadata").exists():
        return mcore_dir / ITER_DIR
    raise ConvertError(f"{mcore_dir}: no {MARKER} and no dist checkpoint (.metadata)")


def plan(mcore_dir: Path, hf_config: Path | None):
    """Every check before anything is written. Returns (family, reader, units in HF order with their bytes)."""
    config_path = hf_config or mcore_dir / "hf" / "config.json"
    try:
        family = family_for(read_config(config_path))
    except (KeyError, ValueError) as error:
        raise ConvertError(f"{config_path}: {error}") from None
    reader = Reader(checkpoint_path(mcore_dir))
    stored = reader.tensors()
    # a training checkpoint may have optimizer state beside the model; only the model's keys must be known
    model_keys = {key for key in stored if key.startswith(PREFIXES)}
    known = {rule.sharded_key(): rule for rule in family.rules}
    unknown = sorted(model_keys - set(known))
    if unknown:
        raise ConvertError(f"unknown key {unknown[0]} in the checkpoint: the {family.name} mapping has no rule for it")
    missing = sorted(set(known) - model_keys)
    if missing:
        raise ConvertError(f"missing key {missing[0]}: the checkpoint has no such tensor")
    units = []
    for rule in family.rules:
        shape, dtype = stored[rule.sharded_key()]
        if rule.stack and shape[0] != family.stacks[rule.stack]:
            raise ConvertError(f"{rule.sharded_key()}: {shape[0]} layers stored, the config says "
                               f"{family.stacks[rule.stack]}")
        numel = 1
        for n in shape[1:] if rule.stack else shape:
            numel *= n
        for layer in family.layers(rule):
            units.append((rule, layer, numel * dtype.itemsize))
    units.sort(key=lambda unit: _hf_order(unit[0].hf_names(unit[1])[0]))
    return family, reader, units


def _hf_order(name: str):
    """visual.* before model.* before lm_head, layers in numeric order (as save_pretrained groups them)."""
    parts = name.split(".")
    return (["visual", "model", "lm_head"].index(parts[0]),
            [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts[1:]])


def convert(mcore_dir, hf_dir, hf_config=None, max_shard_bytes: int = 5 * 10**9) -> dict:
    """Refuses before writing (ConvertError); returns figures (seconds, tensors, bytes, shards)."""
    mcore_dir, hf_dir = Path(mcore_dir), Path(hf_dir)
    require_empty(hf_dir)
    family, reader, units = plan(mcore_dir, Path(hf_config) if hf_config else None)
    try:
        return _write(family, reader, units, mcore_dir, hf_dir, hf_config, max_shard_bytes)
    except BaseException:
        shutil.rmtree(hf_dir, ignore_errors=True)  # it was empty or absent: leave no half-written directory
        raise


def _write(family, reader, units, mcore_dir: Path, hf_dir: Path, hf_config, max_shard_bytes: int) -> dict:
    from safetensors.torch import save_file

    from mm_adaptor.convert.rules import to_hf

    shards, size = [[]], 0
    for unit in units:
        if shards[-1] and size + unit[2] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += unit[2]
    start, weight_map, total = time.time(), {}, 0
    hf_dir.mkdir(parents=True, exist_ok=True)
    for k, shard in enumerate(shards, 1):
        name = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for rule, layer, nbytes in shard:
            tensors.update(zip(rule.hf_names(layer), to_hf(rule, reader.read(rule.sharded_key(), layer))))
            total += nbytes
        save_file(tensors, str(hf_dir / name), metadata={"format": "pt"})
        weight_map.update({tensor_name: name for tensor_name in tensors})
        progress(f"shard {k}/{len(shards)} {name}: {len(weight_map)} tensors, {total / 1e9:.2f} GB, "
                 f"{time.time() - start:.0f} s")
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (hf_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if (mcore_dir / "hf").is_dir():  # the tokenizer/processor files hf-to-mcore kept
        copy_side_files(mcore_dir / "hf", hf_dir)
    if hf_config:
        (hf_dir / "config.json").write_text(Path(hf_config).read_text())
    return {"seconds": time.time() - start, "tensors": len(weight_map), "bytes": total, "shards": len(shards)}
