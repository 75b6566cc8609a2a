"""Megatron dist checkpoint -> HF directory (sharded safetensors + index, config, tokenizer/processor files),
reading one output shard's tensors at a time. Experts are written in the form the installed transformers loads:
fused per layer, (E, H, 2I) / (E, I, H) for 4.x and transposed for 5.x, where its model class fuses them."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from mm_adaptor.convert import ConvertError, fuse, installed_transformers_version
from mm_adaptor.convert.hf_to_mcore import INDEX, copy_side_files, progress, read_config, require_empty
from mm_adaptor.convert.mcore_io import ITER_DIR, MARKER, Reader


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


def _torch_format_problem(path: Path) -> str | None:
    """Megatron's torch format (mp_rank_* directories, --ckpt-format torch) is not read here: the line that says
    how Megatron converts it."""
    if path.is_dir() and any(entry.name.startswith("mp_rank_") for entry in path.iterdir()):
        return (f"{path} is in Megatron's torch format (--ckpt-format torch), which this converter does not read: "
                "convert it to torch_dist with Megatron's own converter, e.g. mm-adaptor train <the run's "
                "arguments> --load DIR --ckpt-convert-format torch_dist --ckpt-convert-save OUT, then convert OUT")
    return None


def plan(mcore_dir: Path, hf_config: Path | None, layout: str | None = None):
    """Every check before anything is written. Returns (family, reader, units in HF order, the transformers major
    whose fused experts layout to write or None); a unit is (first HF name, [(rule, layer)], bytes, fused name or
    None): one tensor, or all experts of a layer that one fused tensor holds."""
    from mm_adaptor.convert.families import checkpoint_family

    config_path = hf_config or mcore_dir / "hf" / "config.json"
    try:
        family = checkpoint_family(read_config(config_path), layout, writing=True)
    except (KeyError, ValueError) as error:
        raise ConvertError(f"{config_path}: {error}") from None
    path = checkpoint_path(mcore_dir)
    problem = _torch_format_problem(path)
    if problem:
        raise ConvertError(problem)
    reader = Reader(path)
    stored = reader.tensors()
    expected = family.checkpoint_keys()
    # a training checkpoint may have optimizer state beside the model; only the model's keys must be known
    prefixes = tuple({key.split(".")[0] + "." for key in expected})
    model_keys = {key for key in stored if key.startswith(prefixes)}
    unknown = sorted(model_keys - set(expected))
    if unknown:
        raise ConvertError(f"unknown key {unknown[0]} in the checkpoint: the {family.name} mapping has no rule for it")
    missing = sorted(set(expected) - model_keys)
    if missing:
        raise ConvertError(f"missing key {missing[0]}: the checkpoint has no such tensor")
    index = family.fused_index() if family.fused_experts else {}
    installed = installed_transformers_version()
    major = int(installed.split(".")[0]) if index and installed else None
    if index and major is None:
        raise ConvertError("transformers is not installed: the layout to write the fused experts in is unknown")
    held_by = {name: fused for fused, (_, held) in index.items() for name in held}
    units, fused_units = [], {}
    for rule in family.rules:
        for layer in family.layers(rule):
            key, _, totals = family.placement(rule, layer)
            shape, dtype = stored[key]
            axes = ["layers"] * (len(totals) - (rule.expert is not None)) + ["experts"] * (rule.expert is not None)
            for axis, (what, total) in enumerate(zip(axes, totals)):
                if shape[axis] != total:
                    raise ConvertError(f"{key}: {shape[axis]} {what} stored, the config says {total}")
            nbytes = math.prod(shape[len(totals):]) * dtype.itemsize
            names = rule.hf_names(layer)
            fused = {held_by.get(name) for name in names}
            if len(fused) > 1:
                raise ConvertError(f"{rule.mcore_name(layer)}: its HF tensors {names} go to different fused tensors")
            fused = fused.pop()
            if fused is None:
                units.append((names[0], [(rule, layer)], nbytes, None))
                continue
            if fused not in fused_units:
                fused_units[fused] = len(units)
                units.append((fused, [], 0, fused))
            name, reads, size, _ = units[fused_units[fused]]
            units[fused_units[fused]] = (name, reads + [(rule, layer)], size + nbytes, fused)
    units.sort(key=lambda unit: _hf_order(unit[0]))
    return family, reader, units, major


def _hf_order(name: str):
    """visual.* before model.* before lm_head, layers in numeric order (as save_pretrained groups them); the
    OpenGVLab layout's vision_model.*, mlp1.*, language_model.* and InternVL's vision_tower.*,
    multi_modal_projector.*, language_model.* likewise."""
    parts = name.split(".")
    return (["visual", "vision_model", "vision_tower", "mlp1", "multi_modal_projector", "model", "language_model",
             "lm_head"].index(parts[0]),
            [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts[1:]])


def convert(mcore_dir, hf_dir, hf_config=None, max_shard_bytes: int = 5 * 10**9, layout: str | None = None) -> dict:
    """Refuses before writing (ConvertError); returns figures (seconds, tensors, bytes, shards). `layout`: which of
    the family's checkpoint layouts to write (InternVL: native, original), None its default."""
    mcore_dir, hf_dir = Path(mcore_dir), Path(hf_dir)
    require_empty(hf_dir)
    family, reader, units, major = plan(mcore_dir, Path(hf_config) if hf_config else None, layout)
    try:
        return _write(family, reader, units, major, mcore_dir, hf_dir, hf_config, max_shard_bytes)
    except BaseException:
        shutil.rmtree(hf_dir, ignore_errors=True)  # it was empty or absent: leave no half-written directory
        raise


def _write(family, reader, units, major, mcore_dir: Path, hf_dir: Path, hf_config, max_shard_bytes: int) -> dict:
    from safetensors.torch import save_file

    from mm_adaptor.convert.rules import to_hf

    shards, size = [[]], 0
    for unit in units:
        if shards[-1] and size + unit[2] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += unit[2]
    start, weight_map, total, fused_written = time.time(), {}, 0, False
    hf_dir.mkdir(parents=True, exist_ok=True)
    for k, shard in enumerate(shards, 1):
        name = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for _, reads, nbytes, fused in shard:
            produced = {}
            for rule, layer in reads:
                key, offsets, _ = family.placement(rule, layer)
                produced.update(zip(rule.hf_names(layer), to_hf(rule, reader.read(key, offsets))))
            tensors.update(fuse(family, produced, major, [fused]) if fused else produced)
            fused_written |= fused is not None
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
    if family.config.get("model_type") != json.loads((hf_dir / "config.json").read_text()).get("model_type"):
        (hf_dir / "config.json").write_text(json.dumps(family.config, indent=2) + "\n")  # another layout's config
    _for_installed(hf_dir / "config.json", major if fused_written else None)
    return {"seconds": time.time() - start, "tensors": len(weight_map), "bytes": total, "shards": len(shards)}


def _for_installed(config_path: Path, fused_major: int | None) -> None:
    """The config as the installed transformers reads it:
    - fused experts went out in its layout: where the config says another major version saved it, it now names
      the installed one, so that a reader of the directory (this converter included) takes them as they are;
    - a config saved by 5.x under an installed 4.x: the spellings 4.x reads (rope_theta beside rope_scaling instead
      of rope_parameters, num_experts instead of num_local_experts, the tied flag in text_config, where 4.x looks,
      set to the top-level one 5.x decided by), else 4.x falls back to its defaults."""
    from mm_adaptor.models.hf_config import saved_by

    version = installed_transformers_version()
    if not config_path.exists() or version is None:
        return
    config = json.loads(config_path.read_text())
    saved, installed = saved_by(config), int(version.split(".")[0])
    if (saved or 0) >= 5 > installed:
        if isinstance(config.get("text_config"), dict) and "tie_word_embeddings" in config:
            config["text_config"]["tie_word_embeddings"] = config["tie_word_embeddings"]
        for section in (config, config.get("text_config")):
            if not isinstance(section, dict):
                continue
            if "num_local_experts" in section:
                section.setdefault("num_experts", section.pop("num_local_experts"))
            if isinstance(section.get("rope_parameters"), dict) and not section.get("rope_scaling"):
                scaling = dict(section.pop("rope_parameters"))
                section["rope_theta"] = scaling.pop("rope_theta", section.get("rope_theta"))
                section["rope_scaling"] = scaling
    elif fused_major is None or saved == fused_major:
        return
    config["transformers_version"] = version
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
