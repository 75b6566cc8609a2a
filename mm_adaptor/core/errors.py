"""Configuration errors the adaptor raises, and the one line they print under the one-line import."""

from __future__ import annotations

import os
import sys
import time


class ConfigurationError(Exception):
    """A configuration the adaptor refuses (feature options, patch contracts, the device asked for).

    Programmatic callers catch it like any exception; uncaught under `import mm_adaptor.megatron_adaptor`
    it prints `mm_adaptor: error: <message>` on rank 0 only (no traceback) and the process exits with 1."""


def one_line(error: BaseException) -> str:
    return "mm_adaptor: error: " + " ".join(str(error).split())


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0").strip() in ("", "0")


# Under torchrun the first rank to exit makes it stop the others; rank 0 prints the arguments table first, so the
# other ranks, failing the same way, give it this long to print the line before they exit.
OTHER_RANKS_GRACE_S = 3.0
_previous_hook = None


def _excepthook(exc_type, exc, tb):
    if isinstance(exc, ConfigurationError):
        if _is_rank_zero():
            print(one_line(exc), file=sys.stderr, flush=True)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(OTHER_RANKS_GRACE_S)
        return  # the interpreter still exits with status 1
    (_previous_hook or sys.__excepthook__)(exc_type, exc, tb)


def install_excepthook() -> None:
    """Chain our hook in front of the current sys.excepthook (idempotent)."""
    global _previous_hook
    if sys.excepthook is _excepthook:
        return
    _previous_hook = sys.excepthook
    sys.excepthook = _excepthook
