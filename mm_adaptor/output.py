"""What a job prints besides its own lines: every distinct warning of its ranks once, and the library notices known
to be harmless here summarised in one line (MM_ADAPTOR_VERBOSE=1, or --verbose, prints them all)."""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

VERBOSE_ENV = "MM_ADAPTOR_VERBOSE"

# (pattern, why it is harmless): megatron saying what it falls back to, or torch deprecations inside its calls.
KNOWN_HARMLESS = (
    (re.compile(r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed"),
     "without Transformer Engine/Apex megatron uses its torch implementations"),
    (re.compile(r"`torch\.distributed\.\w+` is deprecated"), "torch deprecations inside megatron's calls"),
    (re.compile(r"CPU RNG state changed within GPU RNG context"),
     "on the CPU backend megatron's CUDA RNG is the CPU generator"),
    (re.compile(r"RerunStateMachine initialized|Implicit initialization of Rerun State Machine"),
     "megatron's rerun state machine starting"),
)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes")


def harmless_reason(text: str) -> str | None:
    for pattern, reason in KNOWN_HARMLESS:
        if pattern.search(text):
            return reason
    return None


class WarningPrinter:
    """Prints each distinct warning text once; counts the known-harmless ones for one closing line."""

    def __init__(self, stream=None):
        self.stream = stream
        self.shown: set[str] = set()
        self.hidden: dict[str, int] = {}

    def add(self, text: str) -> None:
        if text in self.shown:
            return
        self.shown.add(text)
        reason = None if verbose() else harmless_reason(text)
        if reason is None:
            print(f"warning: {text}", file=self.stream or sys.stderr, flush=True)
        else:
            self.hidden[reason] = self.hidden.get(reason, 0) + 1

    def summary(self) -> str | None:
        if not self.hidden:
            return None
        count = sum(self.hidden.values())
        return (f"note: {count} known-harmless library notice{'s' if count != 1 else ''} not shown "
                f"({'; '.join(self.hidden)}); --verbose shows them")

    def close(self) -> None:
        line = self.summary()
        if line:
            print(line, file=self.stream or sys.stderr, flush=True)
        self.hidden.clear()


class _ForwardRecords(logging.Handler):
    def __init__(self, send):
        super().__init__(logging.WARNING)
        self.send = send

    def emit(self, record):
        self.send(f"{record.levelname.title()}: {record.getMessage()}")


def forward_rank_output(send) -> None:
    """In a rank: its Python warnings and logged warnings go to `send` (the launcher prints them once)."""

    def show(message, category, filename, lineno, file=None, line=None):
        send(f"{category.__name__}: {message}")

    warnings.showwarning = show
    logging.getLogger().addHandler(_ForwardRecords(send))


def print_rank_zero_warnings_once(rank: int) -> None:
    """Under torchrun, where no launcher of ours collects them: rank 0 prints each distinct warning once (the
    known-harmless ones counted when PRINTER closes); the other ranks' warnings are dropped unless verbose."""
    forward_rank_output(PRINTER.add if rank == 0 or verbose() else (lambda text: None))


# One printer per process: a job that launches ranks several times (mm-adaptor check) shows each warning once.
PRINTER = WarningPrinter()
