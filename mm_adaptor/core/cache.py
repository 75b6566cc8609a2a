"""Where mm_adaptor keeps what it computes once for later processes: $XDG_CACHE_HOME/mm_adaptor, else
~/.cache/mm_adaptor."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(name: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mm_adaptor" / name
