"""A data set's index, built once (`mm-adaptor data prepare`, or the first start) and memory-mapped after.

For each good record: its place in its file (file, byte offset and length, line or record number), its token count,
its images' grids and its videos' frame counts, rates and sizes (container headers: no frame is decoded); the
validation report's bad-record lines beside them. The index is keyed by the data files' path and content and by what
its counts depend on (tokenizer, sequence length, image and video preprocessing, max_samples): a change of any gives
another key, so a stale index is never read. Validation runs in a process pool over chunks of records; one process
builds while the others wait on a file lock. A JSON list file is rewritten once, in the index, as one record a
line."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mm_adaptor.data.index_build import ARRAYS, FORMAT, build
from mm_adaptor.data.records import DataError, Sample, data_files, parse_record
from mm_adaptor.data.video import Clip

CACHE_ENV = "MM_ADAPTOR_DATA_CACHE"


def cache_root(cache_dir=None) -> Path:
    """cache_dir (--data-cache), else $MM_ADAPTOR_DATA_CACHE, else the user cache's data-index folder."""
    from mm_adaptor.core.cache import user_cache

    cache_dir = cache_dir or os.environ.get(CACHE_ENV)
    return Path(cache_dir).expanduser().resolve() if cache_dir else user_cache("data-index")


def open_or_build(data_path, tokenizer, seq_length: int, processing, max_samples: int | None = None,
                  cache_dir=None, workers: int | None = None, verbose: bool = False) -> DataIndex:
    """The index of these files and settings under cache_dir (default: the user cache), built here first if no
    process built it yet; a process that finds another building it waits for it."""
    files = data_files(data_path)
    for path in files:
        if not os.path.isfile(path):
            raise DataError(f"data file {path} does not exist")
    key = index_key(files, tokenizer, seq_length, processing, max_samples)
    root = cache_root(cache_dir)
    directory = root / key
    if not (directory / "index.json").exists():
        try:
            root.mkdir(parents=True, exist_ok=True)
            with open(root / f"{key}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not (directory / "index.json").exists():
                    build(files, tokenizer, seq_length, processing, directory, max_samples, workers, verbose)
        except PermissionError as exc:
            raise DataError(f"cannot write the data index under {root} ({exc.strerror}): give a writable "
                            "--data-cache") from None
    elif verbose:
        print(f"mm-adaptor data: the index of {', '.join(files)} is at {directory}", file=sys.stderr)
    return DataIndex(directory)


def index_key(files, tokenizer, seq_length: int, processing, max_samples) -> str:
    """What the index's content depends on, hashed: each file's path and content, the tokenizer, the settings."""
    digest = hashlib.blake2b(digest_size=12)
    parts = {"format": FORMAT, "files": [[path, file_digest(path)] for path in files],
             "tokenizer": tokenizer.identity(), "seq_length": int(seq_length), "processing": repr(processing),
             "max_samples": max_samples}
    digest.update(json.dumps(parts, sort_keys=True).encode())
    return digest.hexdigest()


def file_digest(path, block: int = 8 << 20) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


class DataIndex:
    """An index directory opened: its arrays memory-mapped, records read from their files on demand."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self.meta = json.loads((self.directory / "index.json").read_text())
        if self.meta.get("format") != FORMAT:
            raise DataError(f"{self.directory}: a data index of format {self.meta.get('format')}, not {FORMAT}: "
                            "delete it, it is rebuilt")
        for name in ARRAYS:
            setattr(self, name, np.load(self.directory / f"{name}.npy", mmap_mode="r"))
        self.files = self.meta["files"]
        self._handles: dict = {}

    def __reduce__(self):  # to another process: the directory, reopened there
        return DataIndex, (str(self.directory),)

    def __len__(self) -> int:
        return len(self.lengths)

    def samples(self) -> IndexedSamples:
        return IndexedSamples(self, 0, len(self))

    def bad_lines(self) -> list[str]:
        text = (self.directory / "bad.txt").read_text(encoding="utf-8")
        return text.splitlines()

    def sample(self, i: int) -> Sample:
        file_id, offset, length, number = (int(v) for v in self.spans[i])
        file = self.files[file_id]
        where = f"{file['kind']} {number}"
        try:
            raw = json.loads(self._read(file_id, offset, length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raw, error = None, f"malformed JSON ({exc})"
        else:
            record, error = parse_record(file["source"], where, raw)
        if error:
            raise DataError(f"{file['source']} {where}: changed since it was indexed ({error})")
        record.order = (file_id, number)
        first, last = int(self.grid_offsets[i]), int(self.grid_offsets[i + 1])
        grids = [tuple(int(v) for v in row) for row in self.grids[first:last]]
        first, last = int(self.clip_offsets[i]), int(self.clip_offsets[i + 1])
        clips = [Clip(int(n), float(fps), int(h), int(w)) for n, fps, h, w in self.clips[first:last]]
        return Sample(record, grids, int(self.lengths[i]), clips)

    def _read(self, file_id: int, offset: int, length: int) -> bytes:
        key = (os.getpid(), file_id)  # a forked loader worker opens its own
        if key not in self._handles:
            self._handles[key] = os.open(self.files[file_id]["lines"], os.O_RDONLY)
        return os.pread(self._handles[key], length, offset)


class IndexedSamples(Sequence):
    """Samples start..stop of an index: len(), [i] (a Sample read on demand) and [a:b] (another view)."""

    def __init__(self, index: DataIndex, start: int, stop: int):
        self.index, self.start, self.stop = index, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise TypeError("samples take slices with step 1")
            return IndexedSamples(self.index, self.start + start, self.start + max(start, stop))
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        return self.index.sample(self.start + i)

    @property
    def key(self) -> str:
        """The data's identity: its index's key, and the part of it these samples are."""
        whole = self.start == 0 and self.stop == len(self.index)
        return self.index.directory.name + ("" if whole else f"[{self.start}:{self.stop}]")
