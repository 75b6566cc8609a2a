"""Where the driver's checkpoints live on disk (Megatron-LM's layout: `iter_NNNNNNN` directories and a marker file
naming the latest) and how a finished save is published. Imports neither torch nor megatron, so the argument checks
read it before any rank starts; checkpoint.py writes and reads the shards."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

MARKER = "latest_checkpointed_iteration.txt"
CONTENTS = "mm_adaptor_train.json"  # what a driver's save holds: {"optimizer": bool, "rng": bool, "world_size": n}


def checkpoint_dir(directory, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}"


def latest_checkpoint(directory) -> Path | None:
    """The complete checkpoint the marker under `directory` names, or None when there is no marker. A save of the
    same iteration cut short between its two renames (publish) left the complete one as `iter_N.old`."""
    marker = Path(directory) / MARKER
    if not marker.exists():
        return None
    text = marker.read_text().strip()
    if text == "release":  # Megatron-LM's and MindSpeed-MM's converted checkpoints (convert/mindspeed_mm.py)
        return Path(directory) / text
    final = checkpoint_dir(directory, int(text))
    set_aside = _set_aside(final)
    return set_aside if not final.exists() and set_aside.exists() else final


def _set_aside(final: Path) -> Path:
    return final.with_name(final.name + ".old")


def replace_file(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (a reader sees the old or the new contents, never half of it)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def publish(staging: Path, final: Path) -> None:
    """Rename the finished save into place; an older save of the same iteration is set aside first (and found
    there by latest_checkpoint if the process dies between the two renames)."""
    set_aside = _set_aside(final)
    if final.exists():
        shutil.rmtree(set_aside, ignore_errors=True)
        final.rename(set_aside)
    staging.rename(final)
    shutil.rmtree(set_aside, ignore_errors=True)

