"""What the server that ranks fork from imports once (launcher.py): torch and megatron-core, most of a rank's start.

The warnings and log records these imports raise are kept, and each rank reports them as its own (`replay`), so a
forked rank prints what a spawned one did. Nothing here depends on the rank: options, patches and the device backend
are applied in the rank, after the fork."""

from __future__ import annotations

import logging
import warnings

MODULES = (
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.pipeline_parallel",
)
# torch's own loggers do not propagate to the root: the CUDA-runtime note comes through this one
TORCH_LOGGERS = ("torch.utils.cpp_extension",)


class _Keep(logging.Handler, logging.Filter):
    """Keeps, in the order raised, the warnings shown and the records logged at WARNING or above."""

    def __init__(self):
        logging.Handler.__init__(self, logging.WARNING)
        self.events: list = []

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        self.events.append((message, category, filename, lineno))

    def emit(self, record):
        self.events.append(record)

    def filter(self, record):
        if record.levelno < logging.WARNING:
            return True
        self.events.append(record)
        return False


NOTICES: list = []  # what importing MODULES raised: (message, category, filename, lineno) or a LogRecord


def _preload() -> None:
    keep = _Keep()
    root = logging.getLogger()
    root.addHandler(keep)
    for name in TORCH_LOGGERS:
        logging.getLogger(name).addFilter(keep)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = keep.showwarning
            for module in MODULES:
                try:
                    __import__(module)
                except ImportError:
                    pass
    finally:
        root.removeHandler(keep)
        for name in TORCH_LOGGERS:
            logging.getLogger(name).removeFilter(keep)
    NOTICES.extend(keep.events)


def replay() -> None:
    """In a forked rank, once its own warning handlers are set: the import-time notices, as if raised now."""
    for notice in NOTICES:
        if isinstance(notice, logging.LogRecord):
            logging.getLogger(notice.name).handle(notice)
        else:
            warnings.showwarning(*notice)


_preload()
