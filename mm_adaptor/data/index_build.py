"""Building a data index (mm_adaptor.data.index): every record validated in a process pool over chunks of about
CHUNK_BYTES, a progress line every PROGRESS_SECONDS, the arrays and the bad-record lines written into a staging
directory renamed into place when complete. FORMAT names the layout the index reader expects."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mm_adaptor.data.records import IMAGE_TAG, VIDEO_TAG, DataError, parse_record
from mm_adaptor.data.template import encode

FORMAT = 2
CHUNK_BYTES = 1 << 20  # one pool task: about this many bytes of records
PROGRESS_SECONDS = 10.0
ARRAYS = ("spans", "lengths", "grid_offsets", "grids", "clip_offsets", "clips")


def build(files, tokenizer, seq_length: int, processing, directory, max_samples=None, workers=None,
          verbose=False) -> None:
    """Validate every record (in a pool of `workers` processes, default one per core) and write the index into
    `directory` (through a temporary directory beside it, renamed when complete)."""
    started = time.monotonic()
    directory = Path(directory)
    staging = directory.with_name(f"{directory.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        sources = [_line_source(path, file_id, staging) for file_id, path in enumerate(files)]
        tasks = [task for source in sources for task in _chunks(source)]
        total = sum(task.end - task.start for task in tasks)
        if verbose or total >= 64 << 20:
            print(f"mm-adaptor data: indexing {', '.join(files)} ({total / 1e6:.0f} MB) once, into {directory}",
                  file=sys.stderr, flush=True)
        parts = _validate_chunks(tasks, (tokenizer, processing, seq_length), workers, max_samples, total, started)
        counts = _write(staging, parts, max_samples)
        files_meta = [{"source": s["source"], "kind": s["kind"],  # a rewritten JSON list moves with the index
                       "lines": s["lines"] if s["lines"] == s["source"] else str(directory / Path(s["lines"]).name)}
                      for s in sources]
        meta = {"format": FORMAT, "files": files_meta, "seq_length": int(seq_length),
                "tokenizer": tokenizer.identity(), "processing": repr(processing), "max_samples": max_samples,
                "seconds": round(time.monotonic() - started, 1), **counts}
        (staging / "index.json").write_text(json.dumps(meta, indent=1))
        try:
            os.replace(staging, directory)
        except OSError:  # another builder (a node whose lock this one could not see) finished first: its index
            if not (directory / "index.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    seconds = time.monotonic() - started
    if verbose or seconds >= PROGRESS_SECONDS:
        print(f"mm-adaptor data: indexed {counts['samples']} samples ({counts['bad']} bad) in {seconds:.0f} s: "
              f"{directory}", file=sys.stderr, flush=True)


def _line_source(path: str, file_id: int, staging: Path) -> dict:
    """The file the index reads records from: a JSONL file itself; a JSON list rewritten one record a line."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        return {"file_id": file_id, "source": path, "lines": path, "kind": "line"}
    try:
        with open(path, encoding="utf-8") as f:
            items = json.load(f)
    except json.JSONDecodeError as exc:  # the whole file is lost: a refusal, not a skip
        raise DataError(f"{path}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    lines = staging / f"records-{file_id}.jsonl"
    with open(lines, "w", encoding="utf-8") as out:
        for item in items:
            out.write(json.dumps(item, ensure_ascii=False) + "\n")
    return {"file_id": file_id, "source": path, "lines": str(lines), "kind": "record"}


class Chunk(NamedTuple):
    """A pool task: bytes start..end (whole lines) of the file records are read from, its first line's number."""
    file_id: int
    path: str
    source: str  # the user's file (image paths are relative to its folder)
    kind: str  # "line" (JSONL) or "record" (a JSON list, rewritten)
    start: int
    end: int
    number: int


def _chunks(source: dict):
    """The Chunks of a file, about CHUNK_BYTES each."""
    path, number, start = source["lines"], 1, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK_BYTES)
            if not block:
                return
            if not block.endswith(b"\n"):
                block += f.readline()
            yield Chunk(source["file_id"], path, source["source"], source["kind"], start, start + len(block), number)
            start += len(block)
            number += block.count(b"\n") + (not block.endswith(b"\n"))


def _validate_chunks(tasks, settings, workers, max_samples, total, started):
    """Each chunk's result, in order; stops once max_samples records were read."""
    workers = workers or len(os.sched_getaffinity(0))
    parts, read, done, last = [], 0, 0, started
    if workers <= 1 or len(tasks) <= 1:
        _init_worker(*settings)
        results = map(_index_chunk, tasks)
        pool = None
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                   initializer=_init_worker, initargs=settings)
        results = pool.map(_index_chunk, tasks)
    try:
        for task, part in zip(tasks, results):
            parts.append(part)
            read += part["records"]
            done += task.end - task.start
            if max_samples is not None and read >= max_samples:
                break
            now = time.monotonic()
            if now - last >= PROGRESS_SECONDS:
                last, rate = now, done / max(now - started, 1e-9)
                print(f"mm-adaptor data: {100 * done / total:.0f}% indexed ({read} records, "
                      f"{sum(len(p['bad']) for p in parts)} bad) in {now - started:.0f} s, about "
                      f"{(total - done) / max(rate, 1e-9):.0f} s left", file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return parts


def _write(staging: Path, parts, max_samples) -> dict:
    """The arrays and bad.txt of the first max_samples records (good or bad) of the chunks, in file order."""
    parts = list(parts)
    remaining = max_samples
    for p, part in enumerate(parts if max_samples is not None else []):
        if part["records"] >= remaining:  # the last chunk read: its records up to the max_samples-th
            numbers = sorted([int(n) for n in part["spans"][:, 3]] + [order[1] for order, _ in part["bad"]])
            parts = parts[:p] + [_first_records(part, numbers[remaining - 1])]
            break
        remaining -= part["records"]
    grid_counts = np.concatenate([[0]] + [np.diff(part["grid_offsets"]) for part in parts])
    clip_counts = np.concatenate([[0]] + [np.diff(part["clip_offsets"]) for part in parts])
    arrays = {"spans": np.concatenate([np.zeros((0, 4), np.int64)] + [part["spans"] for part in parts]),
              "lengths": np.concatenate([np.zeros(0, np.int32)] + [part["lengths"] for part in parts]),
              "grid_offsets": np.cumsum(grid_counts, dtype=np.int64),
              "grids": np.concatenate([np.zeros((0, 3), np.int32)] + [part["grids"] for part in parts]),
              "clip_offsets": np.cumsum(clip_counts, dtype=np.int64),
              "clips": np.concatenate([np.zeros((0, 4), np.float64)] + [part["clips"] for part in parts])}
    for name, array in arrays.items():
        np.save(staging / f"{name}.npy", array)
    bad = [line for part in parts for _, line in part["bad"]]
    (staging / "bad.txt").write_text("".join(line + "\n" for line in bad), encoding="utf-8")
    return {"samples": len(arrays["lengths"]), "bad": len(bad)}


def _first_records(part: dict, last_number: int) -> dict:
    keep = part["spans"][:, 3] <= last_number
    kept = {"spans": part["spans"][keep], "lengths": part["lengths"][keep],
            "bad": [b for b in part["bad"] if b[0][1] <= last_number]}
    for rows in ("grids", "clips"):
        counts = np.diff(part[f"{rows[:-1]}_offsets"])
        kept[f"{rows[:-1]}_offsets"] = np.concatenate([[0], np.cumsum(counts[keep])]).astype(np.int64)
        kept[rows] = part[rows][np.repeat(keep, counts)]
    return kept


_WORKER: dict = {}


def _init_worker(tokenizer, processing, seq_length) -> None:
    _WORKER.update(tokenizer=tokenizer, processing=processing, seq_length=seq_length, sizes={})


def _index_chunk(task) -> dict:
    """One chunk's good records (spans, token counts, grids) and bad ones ((order, line) each)."""
    file_id, path, source, kind, start, end, number = task
    with open(path, "rb") as f:
        f.seek(start)
        block = f.read(end - start)
    spans, lengths, grid_counts, grids, clip_counts, clips, bad, records = [], [], [], [], [], [], [], 0
    offset = start
    for line in block.split(b"\n"):
        here, offset = offset, offset + len(line) + 1
        if line.strip():
            records += 1
            where = f"{kind} {number}"
            found = _check_line(source, where, line)
            if isinstance(found, str):
                bad.append(((file_id, number), " ".join(f"{source} {where}: {found}".split())))
            else:
                spans.append((file_id, here, len(line), number))
                lengths.append(found[1])
                grid_counts.append(len(found[0]))
                grids += found[0]
                clip_counts.append(len(found[2]))
                clips += [(c.frames, c.fps, c.height, c.width) for c in found[2]]
        number += 1
    return {"spans": np.array(spans, dtype=np.int64).reshape(-1, 4), "lengths": np.array(lengths, dtype=np.int32),
            "grid_offsets": np.concatenate([[0], np.cumsum(grid_counts, dtype=np.int64)]).astype(np.int64),
            "grids": np.array(grids, dtype=np.int32).reshape(-1, 3),
            "clip_offsets": np.concatenate([[0], np.cumsum(clip_counts, dtype=np.int64)]).astype(np.int64),
            "clips": np.array(clips, dtype=np.float64).reshape(-1, 4), "bad": bad, "records": records}


def _check_line(source: str, where: str, line: bytes):
    """(grids, tokens, clips) of a good record, else the problem (str)."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"malformed JSON ({exc.msg} at column {exc.colno})"
    except UnicodeDecodeError as exc:
        return f"not UTF-8 ({exc.reason} at byte {exc.start})"
    record, error = parse_record(source, where, raw)
    if error:
        return error
    tags = sum(m["content"].count(IMAGE_TAG) for m in record.messages)
    if tags != len(record.images):
        return f"{len(record.images)} images for {tags} {IMAGE_TAG} tags"
    tags = sum(m["content"].count(VIDEO_TAG) for m in record.messages)
    if tags != len(record.videos):
        return f"{len(record.videos)} videos for {tags} {VIDEO_TAG} tags"
    processing = _WORKER["processing"]
    grids = []
    for path in record.images:
        size = _image_size(path)
        if isinstance(size, str):
            return size
        grids.append(processing.grid_for_size(*size))
    clips = []
    for path in record.videos:
        clip = _clip(path, getattr(processing, "video", None))
        if isinstance(clip, str):
            return clip
        clips.append(clip)
    length = len(encode(record, grids, _WORKER["tokenizer"], processing, clips)[0])
    if length > _WORKER["seq_length"]:
        return f"{length} tokens, longer than seq_length {_WORKER['seq_length']}"
    return grids, length, clips


def _image_size(path: str):
    """(width, height) of a readable image (header and checksum checked, once per path in a worker), else the
    problem."""
    sizes = _WORKER["sizes"]
    if path in sizes:
        return sizes[path]
    from PIL import Image

    try:
        with Image.open(path) as image:
            found = image.size
            image.verify()
    except FileNotFoundError:
        found = f"image {path} does not exist"
    except Exception as exc:  # PIL raises many kinds for a broken file
        found = f"image {path} is unreadable ({type(exc).__name__}: {exc})"
    if len(sizes) >= 100_000:
        sizes.clear()
    sizes[path] = found
    return found


def _clip(path: str, processing):
    """A video's Clip (its container header read, its sampling checked), else the problem."""
    if processing is None:
        return (f"video {path}: this model's preprocessing takes no video (Qwen2.5-VL and Qwen3-VL do; a Qwen3-VL "
                "checkpoint needs its video_preprocessor_config.json)")
    from mm_adaptor.data import video

    clips = _WORKER["sizes"]
    if ("video", path) not in clips:
        try:
            found = video.probe(path)
        except (OSError, ValueError) as exc:
            found = str(exc)
        else:
            try:  # too short to sample, too small, too narrow: refused here, not while training
                processing.grid(found)
            except ValueError as exc:
                found = f"video {path}: {exc}"
        clips[("video", path)] = found
    return clips[("video", path)]
