"""Installed megatron targets' fingerprints, kept on disk between processes.

Every rank checks the contracts of the patches it applies, and fingerprinting a target parses its module's source
(megatron's largest files take a tenth of a second each): about a second of each rank's start, every rank, every run.
The fingerprints depend only on megatron's files, this Python's parser and our normalisation, so they are cached under
a key made of exactly those: each .py file's path, size and modification time under megatron's package folders, the
Python version and the text of source_fingerprint.py. Any edit to a megatron file (a Megatron-LM checkout) gives a new
key. A target whose definition is followed into another package is never cached."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

from mm_adaptor.core.cache import user_cache
from mm_adaptor.versions import source_fingerprint

PACKAGE = "megatron"


def cache_folder() -> Path:
    return user_cache("fingerprints")


def tree_key(roots: list[str]) -> str:
    """The key of what fingerprints depend on: every .py file under `roots` (path, size, mtime), this Python, and
    the normalisation's own source."""
    digest = hashlib.sha256(sys.version.encode())
    digest.update(Path(source_fingerprint.__file__).read_bytes())
    for root in sorted(roots):
        for path, size, mtime in sorted(_python_files(root)):
            digest.update(f"{path}\0{size}\0{mtime}\n".encode())
    return digest.hexdigest()[:24]


def _python_files(folder: str):
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                yield from _python_files(entry.path)
            elif entry.name.endswith(".py"):
                with contextlib.suppress(OSError):
                    stat = entry.stat()
                    yield entry.path, stat.st_size, stat.st_mtime_ns


class FingerprintCache:
    def __init__(self, path: Path):
        self.path = path
        self.entries = self._read()

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def put(self, name: str, fingerprint: str | None) -> None:
        """Kept for the next process too: merged with what other processes wrote since, replaced atomically."""
        self.entries[name] = fingerprint
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            merged = {**self._read(), **self.entries}
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as out:
                json.dump(merged, out)
            os.replace(out.name, self.path)


_cache: FingerprintCache | None = None
_cache_looked_up = False


def _current() -> FingerprintCache | None:
    global _cache, _cache_looked_up
    if not _cache_looked_up:
        _cache_looked_up = True
        spec = importlib.util.find_spec(PACKAGE)
        roots = list(spec.submodule_search_locations or []) if spec else []
        if roots:
            _cache = FingerprintCache(cache_folder() / f"{tree_key(roots)}.json")
    return _cache


def installed_fingerprint(target: str, *, signature_only: bool = False) -> str | None:
    """source_fingerprint.installed_fingerprint, from the cache when this megatron tree's is there."""
    cache = _current()
    name = ("signature:" if signature_only else "") + target
    if cache is not None and name in cache.entries:
        return cache.entries[name]
    modules_read: list[str] = []

    def read(module: str) -> str | None:
        text = source_fingerprint.installed_source(module)
        if text is not None:
            modules_read.append(module)
        return text

    fingerprint = source_fingerprint.fingerprint_target(target, read, signature_only=signature_only)
    if cache is not None and all(m.split(".")[0] == PACKAGE for m in modules_read):
        cache.put(name, fingerprint)
    return fingerprint
