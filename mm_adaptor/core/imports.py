"""Importing torch and megatron-core builds about a million objects that live as long as the process. The garbage
collector's passes over them meanwhile find nothing: seven full passes, about 1 of the import's 5 CPU-s (measured:
`import mm_adaptor.megatron_adaptor`, 5.9 CPU-s with the collector, 4.9 without)."""

from __future__ import annotations

import contextlib
import gc

# The launcher's young-generation threshold (CPython's default is 700 allocations): its imports happen deep inside
# each command, after the command line is checked, so it collects less often for its whole life instead.
LAUNCHER_GC_THRESHOLD = 10_000


@contextlib.contextmanager
def without_gc():
    """The collector off for the block (imports), as it was after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
