"""HF directory -> Megatron dist checkpoint, one input shard in memory at a time.

Output: OUT/latest_checkpointed_iteration.txt ("0") and OUT/iter_0000000 (what the built-in driver's --load
reads), OUT/hf/ (the HF config, tokenizer and processor files) and OUT/mm_adaptor_convert.json (family, layout)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from mm_adaptor.convert import ConvertError, check_names, family_for
from mm_adaptor.convert.layout import validate
from mm_adaptor.convert.mcore_io import INFO, ITER_DIR, MARKER, PieceWriter, single_process_group

INDEX = "model.safetensors.index.json"


def hf_files(hf_dir: Path) -> list[Path]:
    """The directory's safetensors shards, in the index's order (or the one model.safetensors)."""
    if (hf_dir / INDEX).exists():
        weight_map = json.loads((hf_dir / INDEX).read_text())["weight_map"]
        return [hf_dir / name for name in dict.fromkeys(sorted(set(weight_map.values())))]
    if (hf_dir / "model.safetensors").exists():
        return [hf_dir / "model.safetensors"]
    raise ConvertError(f"{hf_dir}: no {INDEX} and no model.safetensors")


def read_config(path: Path) -> dict:
    if not path.exists():
        raise ConvertError(f"{path}: no such file (the HF config)")
    return json.loads(path.read_text())


def require_empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"output directory {out} is not empty")


def copy_side_files(source: Path, target: Path) -> None:
    """config.json, tokenizer and processor files: every plain file that is not a weight."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != INDEX:
            shutil.copy2(path, target / path.name)


def progress(message: str) -> None:
    print(f"convert: {message}", file=sys.stderr, flush=True)


def plan(hf_dir: Path, tp: int, llm, vit):
    """Every check before anything is written: config, layout, names. Returns (family, layout, shard files)."""
    from safetensors import safe_open

    from mm_adaptor.convert.families import dims_for

    try:
        family = family_for(read_config(hf_dir / "config.json"))
    except (KeyError, ValueError) as error:
        raise ConvertError(f"{hf_dir / 'config.json'}: {error}") from None
    layout = validate(dims_for(family.config), tp, llm, vit)
    files = hf_files(hf_dir)
    names = []
    for path in files:
        if not path.exists():
            raise ConvertError(f"{path}: named by {INDEX} but missing")
        with safe_open(str(path), "pt") as f:
            names += list(f.keys())
    check_names(family, names)
    return family, layout, files


def convert(hf_dir, out, tp: int = 1, llm=None, vit=None) -> dict:
    """Refuses before writing (ConvertError); returns figures (seconds, tensors, bytes)."""
    hf_dir, out = Path(hf_dir), Path(out)
    require_empty(out)
    family, layout, files = plan(hf_dir, tp, llm, vit)
    try:
        return _write(family, layout, files, hf_dir, out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # it was empty or absent: leave no half-written checkpoint
        raise


def _write(family, layout, files, hf_dir: Path, out: Path) -> dict:
    from safetensors import safe_open

    from mm_adaptor.convert.rules import to_mcore

    index = family.hf_index()
    start, done, total_bytes = time.time(), 0, 0
    out.mkdir(parents=True, exist_ok=True)
    pending: dict[tuple, dict] = {}  # (rule's key, layer) -> {position: tensor} until every part arrived
    with single_process_group():
        writer = PieceWriter(out / ".staging")
        for k, path in enumerate(files, 1):
            tensors = []
            with safe_open(str(path), "pt") as f:
                for name in f.keys():
                    canonical = family.canonical_hf(name)
                    if canonical in family.ignored_hf:
                        continue
                    rule, layer, position = index[canonical]
                    parts = pending.setdefault((rule.mcore, layer), {})
                    parts[position] = f.get_tensor(name)
                    if len(parts) == len(rule.hf):
                        del pending[(rule.mcore, layer)]
                        tensor = to_mcore(rule, [parts[i] for i in range(len(rule.hf))])
                        tensors.append((rule.sharded_key(), tensor, layer, family.stacks.get(rule.stack)))
                        total_bytes += tensor.numel() * tensor.element_size()
            objects = [] if k > 1 else [
                (key.replace("{i}.", ""), layer, family.stacks.get(stack))
                for key, stack in family.extra_states.items()
                for layer in (range(family.stacks[stack]) if stack else [None])]
            if tensors or objects or k == 1:
                writer.save(tensors, objects, {"mm_adaptor_convert": {"family": family.name, **layout.to_dict()}})
            done += len(tensors)
            del tensors
            progress(f"shard {k}/{len(files)} {path.name}: {done} tensors, {total_bytes / 1e9:.2f} GB, "
                     f"{time.time() - start:.0f} s")
        writer.finish(out / ITER_DIR)
    (out / MARKER).write_text("0")
    copy_side_files(hf_dir, out / "hf")
    info = {"family": family.name, "layout": layout.to_dict(), "source": str(hf_dir), "tensors": done,
            "note": "a dist checkpoint holds whole tensors; megatron reshards it on load, the layout is the one "
                    "this conversion checked and prepared it for"}
    (out / INFO).write_text(json.dumps(info, indent=2) + "\n")
    return {"seconds": time.time() - start, "tensors": done, "bytes": total_bytes}
