"""MindSpeed-MM's messages format: reading, LLaVA conversion, and the validation pass's bad-record lines.

A data file is JSON (a list of records) or JSONL (one record a line):
  {"messages": [{"role": "user", "content": "<image>What is in the picture?"},
                {"role": "assistant", "content": "..."}], "images": ["path.jpg"]}
Image and video paths ("videos": ["clip.mp4"], one `<video>` tag each) are relative to the data file's folder. An
optional first message with role "system" replaces the default system prompt; then user and assistant turns
alternate, starting with the user."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from mm_adaptor.core.errors import ConfigurationError

IMAGE_TAG = "<image>"
VIDEO_TAG = "<video>"


class DataError(ConfigurationError):
    """Bad data or a tokenizer that does not fit the model: one line, as every ConfigurationError."""


@dataclass
class Record:
    """One sample: its data file, where in it ('record N' or 'line N'), its messages, absolute image and video
    paths."""
    file: str
    where: str
    messages: list
    images: list = field(default_factory=list)
    order: tuple = (0, 0)  # (file index, record or line number): sorts reports in file order
    videos: list = field(default_factory=list)


@dataclass
class Sample:
    """A validated record: its image grids (grid_thw per image, from the image's size), its token count and its
    videos' data.video.Clip (frame count, rate and size, from the container)."""
    record: Record
    grids: list
    length: int
    clips: list = field(default_factory=list)


def data_files(data_path) -> list[str]:
    """A path, a comma-separated string of paths, or a list of them."""
    if isinstance(data_path, str):
        data_path = [p for p in data_path.split(",") if p.strip()]
    return [os.path.abspath(os.path.expanduser(p.strip())) for p in data_path]


def parse_record(path, where, raw):
    """(Record, None) of a parsed JSON value of data file `path`, else (None, the problem)."""
    if not isinstance(raw, dict):
        return None, f"not a JSON object but {type(raw).__name__}"
    messages = raw.get("messages")
    if "conversations" in raw and messages is None:
        return None, ('missing key "messages": this is LLaVA\'s "conversations" form; '
                      "`mm-adaptor data llava-to-messages IN OUT` converts it")
    if not isinstance(messages, list) or not messages:
        return None, 'missing key "messages" (a non-empty list)'
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            return None, f'message {i} lacks "role" or "content"'
        if not isinstance(message["content"], str):
            return None, f"message {i}'s content is not a string"
    roles = [m["role"] for m in messages]
    turns = roles[1:] if roles[0] == "system" else roles
    expected = ["user", "assistant"] * (len(turns) // 2)
    if not turns or turns != expected or len(turns) % 2:
        return None, f"roles {roles}: want an optional system, then user and assistant turns alternating"
    paths = {}
    for key in ("images", "videos"):
        found = raw.get(key) or []
        found = [found] if isinstance(found, str) else found
        if not isinstance(found, list) or not all(isinstance(i, str) for i in found):
            return None, f'"{key}" is not a list of paths'
        paths[key] = [os.path.join(os.path.dirname(path), i) for i in found]
    return Record(path, where, messages, paths["images"], videos=paths["videos"]), None


def llava_to_messages(in_path: str, out_path: str, image_folder: str | None = None) -> int:
    """LLaVA records ({"image": ..., "conversations": [{"from": "human"|"gpt", "value": ...}]}) -> a messages JSON
    file; image paths (relative to image_folder, default IN's folder) are rewritten relative to OUT's folder.
    Returns the number of records written."""
    with open(in_path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        items = json.loads(text)
    else:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    source = os.path.abspath(image_folder or os.path.dirname(os.path.abspath(in_path)))
    target = os.path.dirname(os.path.abspath(out_path))
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
    out = []
    for number, item in enumerate(items, 1):
        try:
            messages = [{"role": roles[turn["from"]], "content": turn["value"]} for turn in item["conversations"]]
        except (KeyError, TypeError) as exc:
            raise DataError(f"{in_path} record {number}: not a LLaVA record ({exc!r})") from None
        record = {"messages": messages}
        image = item.get("image")
        if image:
            paths = image if isinstance(image, list) else [image]
            record["images"] = [os.path.relpath(os.path.join(source, p), target) for p in paths]
        out.append(record)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
    return len(out)
