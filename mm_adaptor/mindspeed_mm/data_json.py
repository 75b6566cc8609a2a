"""--mm-data FILE: MindSpeed-MM's data.json (template qwen2vl) as the driver's data settings.

The dataset file is read through its `attr` key mapping (messages, role/content tags, user/assistant/system tags,
images), its images resolved against dataset_dir first (as MindSpeed-MM does) and then as given, and written once as
the driver's messages format (mm_adaptor/data/records.py) to a file named by its content under the temporary
folder; --data-path names that file. image_min/max_pixels bound the images; model_name_or_path gives the tokenizer
and the image processor's settings. Fields that tune their loader are accepted with a note; fields that would change
the samples or the loss and are not supported are refused in one line."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from mm_adaptor.mindspeed_mm.json_file import read_json

DEFAULT_ATTR = {"messages": "messages", "role_tag": "role", "content_tag": "content", "user_tag": "user",
                "assistant_tag": "assistant", "system_tag": None, "images": "images", "videos": None, "system": None}
# present with a value other than this: refused (what it would change, and the supported value)
UNSUPPORTED = (
    ("basic_parameters", "template", "qwen2vl", "the chat template"),
    ("basic_parameters", "train_on_prompt", False, "which tokens the loss counts"),
    ("basic_parameters", "mask_history", False, "which turns the loss counts"),
    ("basic_parameters", "tool_format", None, "tool calls in the samples"),
    ("attr", "observation_tag", None, "tool observations in the samples"),
    ("attr", "function_tag", None, "function calls in the samples"),
    ("collate_param", "ignore_pad_token_for_loss", True, "whether padding counts in the loss"),
)
# their loader's settings: accepted, no effect here
LOADER_FIELDS = (
    ("dataset_param", "dataset_type"), ("basic_parameters", "cache_dir"),
    ("basic_parameters", "preprocessing_batch_size"), ("basic_parameters", "preprocessing_num_workers"),
    ("preprocess_parameters", "use_fast_tokenizer"), ("preprocess_parameters", "split_special_tokens"),
    ("dataloader_param", "dataloader_mode"), ("dataloader_param", "sampler_type"), ("dataloader_param", "drop_last"),
    ("dataloader_param", "pin_memory"), ("dataloader_param", "shuffle"), ("dataloader_param", "num_workers"),
    ("collate_param", "model_name"),
)
LOADER_NOTE = ("the trainer builds its batches in the rank, draws a seeded permutation per epoch and keeps whole "
               "global batches")


class DataJsonError(ValueError):
    pass


def _sections(data: dict) -> dict:
    param = data.get("dataset_param") or {}
    loader = data.get("dataloader_param") or {}
    return {"dataset_param": param, "basic_parameters": param.get("basic_parameters") or {},
            "preprocess_parameters": param.get("preprocess_parameters") or {}, "attr": param.get("attr") or {},
            "dataloader_param": loader, "collate_param": loader.get("collate_param") or {}}


def read(path: str) -> dict:
    data = read_json("--mm-data", path, DataJsonError)
    if not isinstance(data, dict) or not isinstance(data.get("dataset_param"), dict):
        raise DataJsonError(f"--mm-data {path}: no dataset_param object (MindSpeed-MM's data.json schema)")
    return data


def dataset_files(sections: dict, path: str) -> list[Path]:
    """basic_parameters.dataset, one file or several separated by commas (read one after the other, as MindSpeed-MM
    concatenates them): each as given (relative to the working directory), else relative to dataset_dir."""
    basic = sections["basic_parameters"]
    names = basic.get("dataset")
    if not names or not isinstance(names, str):
        raise DataJsonError(f"--mm-data {path}: dataset_param.basic_parameters.dataset names no file")
    folder = basic.get("dataset_dir") or "."
    files = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        found = [c for c in (Path(name), Path(folder) / name) if c.is_file()]
        if not found:
            raise DataJsonError(f"--mm-data {path}: dataset {name} does not exist (nor under dataset_dir {folder})")
        files.append(found[0].resolve())
    return files


def _media(name: str, folder: str) -> str:
    """Their rule: dataset_dir/name when that file exists, else name as given."""
    joined = os.path.join(folder, name)
    return os.path.abspath(joined if os.path.isfile(joined) else name)


def _records(raw_records, attr: dict, folder: str) -> list:
    roles = {attr["user_tag"]: "user", attr["assistant_tag"]: "assistant"}
    if attr.get("system_tag"):
        roles[attr["system_tag"]] = "system"
    out = []
    for raw in raw_records:
        if not isinstance(raw, dict):
            out.append(raw)  # the driver's reader names what is wrong with it
            continue
        messages = raw.get(attr["messages"])
        if isinstance(messages, list):
            messages = [{"role": roles.get(m.get(attr["role_tag"]), m.get(attr["role_tag"])),
                         "content": m.get(attr["content_tag"])} if isinstance(m, dict) else m for m in messages]
            if attr.get("system") and raw.get(attr["system"]):
                messages = [{"role": "system", "content": raw[attr["system"]]}, *messages]
        record = {"messages": messages}
        for kind in ("images", "videos"):
            media = raw.get(attr[kind]) if attr.get(kind) else None
            if media:
                media = [media] if isinstance(media, str) else media
                record[kind] = [_media(i, folder) if isinstance(i, str) else i for i in media]
        out.append(record)
    return out


def _read_dataset(file: Path, path: str) -> list:
    text = file.read_text()
    try:
        if file.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        records = json.loads(text)
    except ValueError as exc:
        raise DataJsonError(f"--mm-data {path}: dataset {file} is not JSON ({exc})") from None
    if not isinstance(records, list):
        raise DataJsonError(f"--mm-data {path}: dataset {file} is not a list of records")
    return records


def normalized_dataset(sections: dict, path: str, file: Path) -> Path:
    """The dataset in the driver's messages format, written once (every rank and every later start finds the same
    file)."""
    attr = {**DEFAULT_ATTR, **{k: v for k, v in sections["attr"].items() if k in DEFAULT_ATTR}}
    for key in ("messages", "role_tag", "content_tag", "user_tag", "assistant_tag"):
        if not attr[key]:
            raise DataJsonError(f"--mm-data {path}: attr.{key} is empty: name the record's key")
    limit = sections["basic_parameters"].get("max_samples")
    folder = sections["basic_parameters"].get("dataset_dir") or "."
    # named by what it is made of (the file as its size and modification time say, and the settings), so that a
    # later start finds it without reading the dataset again
    stat = file.stat() if file.is_file() else None
    made_of = json.dumps([str(file), stat and (stat.st_size, stat.st_mtime_ns), attr, folder, limit], sort_keys=True)
    digest = hashlib.sha256(made_of.encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / "mm-adaptor-mm-data" / f"{file.stem}-{digest}.json"
    if out.exists():
        return out
    records = _read_dataset(file, path)
    if limit is not None:
        records = records[:int(limit)]
    text = json.dumps(_records(records, attr, folder), ensure_ascii=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    partial.write_text(text)
    partial.replace(out)
    return out


def _has_tokenizer(directory: Path) -> bool:
    return (directory / "tokenizer.json").is_file()


def apply(args, path: str) -> list[str]:
    """Set the driver's data flags from the data.json; returns the notes to print. Raises DataJsonError."""
    data = read(path)
    sections = _sections(data)
    for section, key, wanted, what in UNSUPPORTED:
        value = sections[section].get(key, wanted)
        if value != wanted:
            raise DataJsonError(f"--mm-data {path}: {section}.{key} {value!r} changes {what}, which is not "
                                f"supported here: give {wanted!r}")
    loader = [f"{section}.{key}" for section, key in LOADER_FIELDS if sections[section].get(key) is not None]
    notes = [f"--mm-data {path}: {', '.join(loader)}: no effect here ({LOADER_NOTE})"] if loader else []
    # several files: a blend weighted by their sizes (train.vlm_data), drawn in the proportions of their concatenation
    datasets = [str(normalized_dataset(sections, path, file)) for file in dataset_files(sections, path)]
    given = args.data_path if isinstance(args.data_path, list) else [args.data_path] if args.data_path else []
    if given and [os.path.abspath(p) for p in given] != datasets:
        raise DataJsonError(f"--data-path {' '.join(given)} and --mm-data {path} both name the data set: give one")
    args.data_path = datasets
    if args.split is None:  # their data.json trains on every record
        args.split = "100,0,0"
    pre = sections["preprocess_parameters"]
    low, high = pre.get("image_min_pixels"), pre.get("image_max_pixels")
    if low is not None:
        args.image_min_pixels = max(1, int(low))  # their 0: no lower bound
    if high is not None:
        args.image_max_pixels = int(high)
    for theirs, ours, kind in (("video_min_pixels", "video_min_pixels", int),
                               ("video_max_pixels", "video_max_pixels", int), ("video_fps", "video_fps", float),
                               ("video_maxlen", "video_max_frames", int)):
        if pre.get(theirs) is not None:  # (their video_min_pixels 0: no lower bound)
            setattr(args, ours, max(1, kind(pre[theirs])) if theirs == "video_min_pixels" else kind(pre[theirs]))
    source = pre.get("model_name_or_path")
    if source:
        directory = Path(source)
        if (directory / "preprocessor_config.json").is_file():
            args.image_processor_dir = str(directory)
        if _has_tokenizer(directory):
            args.tokenizer_model = args.tokenizer_model or str(directory)
        elif not args.tokenizer_model:
            notes.append(f"--mm-data preprocess_parameters.model_name_or_path {source} holds no tokenizer.json: "
                         "the tokenizer is --load's hf/, else the built-in byte tokenizer (a tiny model's only)")
    return notes
