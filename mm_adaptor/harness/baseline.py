"""The unpatched baseline, trained once per configuration and kept on disk.

A baseline depends on the driver's arguments, the versions of torch and megatron-core, the adaptor's own sources
(its backends and compatibility fixes run in the baseline too) and the MM_ADAPTOR_* environment; the cache key
covers all of them. MM_ADAPTOR_BASELINE_CACHE names the directory (default ~/.cache/mm_adaptor/baselines);
`off` disables the cache.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import tempfile
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

CACHE_ENV = "MM_ADAPTOR_BASELINE_CACHE"
# Arguments that change how a run reports, not what it computes.
_NOT_IN_KEY = {"dump", "quiet", "silent", "timeout", "log_interval", "validated_data"}
# Plugin features are off in a baseline, so they apply nothing to it.
_ENV_NOT_IN_KEY = {CACHE_ENV, "MM_ADAPTOR_FEATURE_MODULES"}
_SOURCE_SUFFIXES = (".py", ".cpp", ".cu", ".h")


def cache_dir() -> Path | None:
    setting = os.environ.get(CACHE_ENV, "").strip()
    if setting.lower() == "off":
        return None
    return Path(setting) if setting else Path.home() / ".cache" / "mm_adaptor" / "baselines"


@lru_cache(maxsize=1)
def _sources_digest() -> str:
    import mm_adaptor
    import mm_adaptor.feature_flags
    import mm_adaptor.ops
    import mm_adaptor.patches

    digest = hashlib.sha256()
    for package in (mm_adaptor, mm_adaptor.patches, mm_adaptor.ops, mm_adaptor.feature_flags):
        for root in package.__path__:
            for path in sorted(Path(root).rglob("*")):
                if path.suffix in _SOURCE_SUFFIXES and "__pycache__" not in path.parts:
                    digest.update(str(path.relative_to(root)).encode())
                    digest.update(path.read_bytes())
    return digest.hexdigest()


def key(args: argparse.Namespace) -> str:
    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    from mm_adaptor.core import features
    switched_off = {(flag.dest, repr(flag.default_value())) for _, flag in features.all_flags()}
    described = {
        "args": {k: v for k, v in sorted(vars(args).items())
                 if k not in _NOT_IN_KEY and (k, repr(v)) not in switched_off},
        "versions": {d: version(d) for d in ("torch", "megatron-core", "mm-adaptor")},
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith("MM_ADAPTOR_") and k not in _ENV_NOT_IN_KEY},
        "sources": _sources_digest(),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:24]


def cached_run(args: argparse.Namespace, *, echo: bool = False):
    """train.run(args), reusing an identical earlier run from the cache."""
    import torch

    from mm_adaptor.harness import runner as train

    directory = cache_dir()
    path = directory / f"{key(args)}.pt" if directory else None
    if path is not None and path.exists():
        stored = torch.load(path)
        return train.Dump(ranks=[train.RankDump(**r) for r in stored["ranks"]], args=stored["args"])
    dump = train.run(args, echo=echo)
    if path is not None:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, suffix=".tmp", delete=False) as handle:
            torch.save(asdict(dump), handle)
        os.replace(handle.name, path)
    return dump


def initial_checkpoint(args: argparse.Namespace, scratch: Path, *, echo: bool = False) -> Path:
    """A weights-only checkpoint of the model `args` builds, before any step (cached like a baseline)."""
    from mm_adaptor.harness import runner as train
    from mm_adaptor.harness.runner.checkpoint import latest_checkpoint

    init = argparse.Namespace(**vars(args))
    init.train_iters, init.save, init.load = 0, None, None
    directory = cache_dir()
    target = directory / f"init-{key(init)}" if directory else scratch / "init"
    if latest_checkpoint(target) is not None:
        return target
    init.save = str(target)
    train.run(init, echo=echo)
    return target
