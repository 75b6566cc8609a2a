"""HF directory -> Megatron dist checkpoint, one input shard in memory at a time.

Output: OUT/latest_checkpointed_iteration.txt ("0") and OUT/iter_0000000 (what the built-in driver's --load
reads), OUT/hf/ (the HF config, tokenizer and processor files) and OUT/mm_adaptor_convert.json (family, layout)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from mm_adaptor.convert import ConvertError, check_names, fused_layout_major, split_fused
from mm_adaptor.convert.layout import validate
from mm_adaptor.convert.mcore_io import INFO, ITER_DIR, MARKER, PieceWriter, single_process_group

INDEX = "model.safetensors.index.json"
# converted tensors are saved as a piece of the checkpoint once they reach this size (and at each input shard's
# end): memory holds one input shard's tensors at most, and megatron's writer copies a piece at a time
PIECE_BYTES = 1 << 28


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


def plan(hf_dir: Path, tp: int, llm, vit, ep: int = 1, moe_tp_extend_ep: bool = False):
    """Every check before anything is written: config (the family's model must take it), layout, names, the fused
    experts' layout. Returns (family, layout, shard files, the fused experts' transformers major or None)."""
    from safetensors import safe_open

    from mm_adaptor.convert.families import checkpoint_family, dims_for

    config_path = hf_dir / "config.json"
    try:
        family = checkpoint_family(read_config(config_path))
        dims = dims_for(family.config)
    except (KeyError, ValueError) as error:
        raise ConvertError(f"{config_path}: {error}") from None
    layout = validate(dims, tp, llm, vit, ep, family.num_experts, moe_tp_extend_ep)
    files = hf_files(hf_dir)
    shapes = {}
    for path in files:
        if not path.exists():
            raise ConvertError(f"{path}: named by {INDEX} but missing")
        with safe_open(str(path), "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    check_names(family, shapes)
    return family, layout, files, check_fused(family, shapes)


def check_fused(family, shapes: dict) -> int | None:
    """The transformers major whose layout the checkpoint's fused experts are in (None without fused experts),
    after checking each layer's pair against it: per expert, gate_up_proj's rows are down_proj's columns twice over
    and its columns down_proj's rows, read as that version stores them. Decided by the saving version, never by
    the shapes (a square expert matrix reads either way); a pair that does not fit it is refused."""
    index = family.fused_index()
    fused = {family.canonical_hf(name): shape for name, shape in shapes.items() if family.canonical_hf(name) in index}
    if not fused:
        return None
    major = fused_layout_major(family)
    linear = {}  # name -> per-expert (out, in) of one part, as a Linear weight
    for name, shape in fused.items():
        parts, held = len(index[name][0].parts), index[name][1]
        if len(shape) != 3 or shape[0] * parts != len(held):
            raise ConvertError(f"{name}: shape {shape}, expected {len(held) // parts} experts on the first axis")
        out, into = (shape[1], shape[2]) if major >= 5 else (shape[2], shape[1])
        linear[name] = (out // parts, into)
    for name in fused:
        if name.endswith(".gate_up_proj") and name[:-len("gate_up_proj")] + "down_proj" in fused:
            down = name[:-len("gate_up_proj")] + "down_proj"
            if linear[name] != linear[down][::-1]:
                said = (f"config.json's transformers_version {family.config['transformers_version']} says"
                        if family.config.get("transformers_version") else
                        "config.json names no transformers_version, so the installed transformers' is taken")
                layout = "(E, out, in)" if major >= 5 else "(E, in, out)"
                raise ConvertError(f"{name} {fused[name]} and down_proj {fused[down]} are not one expert MLP in "
                                   f"transformers {major}.x's layout {layout}: {said}")
    return major


def convert(hf_dir, out, tp: int = 1, llm=None, vit=None, ep: int = 1, moe_tp_extend_ep: bool = False) -> dict:
    """Refuses before writing (ConvertError); returns figures (seconds, tensors, bytes)."""
    hf_dir, out = Path(hf_dir), Path(out)
    require_empty(out)
    family, layout, files, major = plan(hf_dir, tp, llm, vit, ep, moe_tp_extend_ep)
    try:
        return _write(family, layout, files, hf_dir, out, major)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # it was empty or absent: leave no half-written checkpoint
        raise


def own_bytes(tensor):
    """The tensor, contiguous and owning exactly its bytes (a view of a fused experts tensor would save all of it)."""
    import torch

    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _write(family, layout, files, hf_dir: Path, out: Path, major: int | None) -> dict:
    from safetensors import safe_open

    from mm_adaptor.convert.rules import to_mcore

    index, fused = family.hf_index(), family.fused_index()
    start, done, total_bytes = time.time(), 0, 0
    out.mkdir(parents=True, exist_ok=True)
    pending: dict[tuple, dict] = {}  # (rule's key, layer) -> {position: tensor} until every part arrived
    metadata = {"mm_adaptor_convert": {"family": family.name, **layout.to_dict()}}
    with single_process_group():
        writer = PieceWriter(out / ".staging")
        tensors, buffered = [], 0

        def flush():  # the converted tensors as a piece (the first piece also holds the _extra_state objects)
            nonlocal tensors, buffered, done
            writer.save(tensors, [] if writer.pieces else family.object_placements(), metadata)
            done += len(tensors)
            tensors, buffered = [], 0

        for k, path in enumerate(files, 1):
            with safe_open(str(path), "pt") as f:
                for name in f.keys():
                    canonical = family.canonical_hf(name)
                    if canonical in family.ignored_hf:
                        continue
                    pieces = (split_fused(family, canonical, f.get_tensor(name), major) if canonical in fused
                              else [(canonical, f.get_tensor(name))])
                    for piece_name, piece in pieces:
                        rule, layer, position = index[piece_name]
                        parts = pending.setdefault((rule.mcore, layer), {})
                        parts[position] = piece
                        if len(parts) == len(rule.hf):
                            del pending[(rule.mcore, layer)]
                            tensor = own_bytes(to_mcore(rule, [parts[i] for i in range(len(rule.hf))]))
                            key, offsets, totals = family.placement(rule, layer)
                            tensors.append((key, tensor, offsets, totals))
                            nbytes = tensor.numel() * tensor.element_size()
                            total_bytes, buffered = total_bytes + nbytes, buffered + nbytes
                            if buffered >= PIECE_BYTES:
                                flush()
                    del pieces
            if tensors or not writer.pieces:
                flush()
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
