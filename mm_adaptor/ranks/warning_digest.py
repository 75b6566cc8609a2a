"""What a job prints besides its own lines: every distinct warning of its ranks once, and the library notices known
to be harmless here summarised in one line (MM_ADAPTOR_VERBOSE=1, or --verbose, prints them all)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import re
import sys
import warnings

VERBOSE_ENV = "MM_ADAPTOR_VERBOSE"

# (pattern, why it is harmless): megatron saying what it falls back to, or torch deprecations inside its calls.
KNOWN_HARMLESS = (
    (re.compile(r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed|Only transformer-engine>=[\d.]+ "
                r"supports MoE experts"),
     "without Transformer Engine/Apex megatron uses its torch implementations"),
    (re.compile(r"`torch\.distributed\.\w+` is deprecated"), "torch deprecations inside megatron's calls"),
    (re.compile(r"CPU RNG state changed within GPU RNG context"),
     "on the CPU backend megatron's CUDA RNG is the CPU generator"),
    (re.compile(r"RerunStateMachine initialized|Implicit initialization of Rerun State Machine"),
     "megatron's rerun state machine starting"),
    (re.compile(r"No CUDA runtime is found, using CUDA_HOME"), "a CUDA build of torch on a machine without a GPU"),
    # megatron-core 0.19's import-time notices
    (re.compile(r"absl\.logging is not installed"), "megatron logs through Python's logging without absl"),
    (re.compile(r"MimoModelConfig is experimental"), "megatron announcing its experimental modules"),
    (re.compile(r"Setting RerunStateMachine mode|Result validation enabled"),
     "megatron's rerun state machine switching mode around evaluation"),
    (re.compile(r"(?s)recommended to use a ModelConfig"),
     "megatron 0.19 recommending a ModelConfig; the trainer's families build from model providers"),
    (re.compile(r"GPTModel IS DEPRECATED"),
     "megatron 0.19 deprecating GPTModel for HybridModel (the trainer builds one with --hybrid-layer-pattern)"),
)


class ShowEveryWarning(argparse.Action):
    """--verbose: sets MM_ADAPTOR_VERBOSE=1 for this process and the ranks it starts."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        os.environ[VERBOSE_ENV] = "1"
        setattr(namespace, self.dest, True)


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


_undo_command_forwarding = None  # set while a command's own warnings go to PRINTER (own_warnings_as_the_ranks)


def forward_rank_output(send) -> None:
    """In a rank: its Python warnings and logged warnings go to `send` (the launcher prints them once). A command
    that is itself a rank (under torchrun) hands its own forwarding over, so nothing is printed twice."""
    global _undo_command_forwarding
    if _undo_command_forwarding is not None:
        _undo_command_forwarding()
        _undo_command_forwarding = None
    forwarding(send)


def forwarding(send):
    """Python warnings and logged warnings go to `send`; returns what undoes it."""

    def show(message, category, filename, lineno, file=None, line=None):
        send(f"{category.__name__}: {message}")

    previous, handler, instead = warnings.showwarning, _ForwardRecords(send), _SendInstead(send)
    warnings.showwarning = show
    logging.getLogger().addHandler(handler)
    # torch's own loggers print through torch's handler, not the root's: its import-time note reaches `send` too
    logging.getLogger(TORCH_CPP_EXTENSION_LOGGER).addFilter(instead)

    def undo():
        warnings.showwarning = previous
        logging.getLogger().removeHandler(handler)
        logging.getLogger(TORCH_CPP_EXTENSION_LOGGER).removeFilter(instead)

    return undo


@contextlib.contextmanager
def own_warnings_as_the_ranks():
    """A command's own warnings (megatron's import-time notices when `report` imports it) are printed the way its
    ranks' are: each distinct one once, the known-harmless ones counted in PRINTER's closing line."""
    global _undo_command_forwarding
    _undo_command_forwarding = forwarding(PRINTER.add)
    try:
        yield
    finally:
        if _undo_command_forwarding is not None:
            _undo_command_forwarding()
            _undo_command_forwarding = None


TORCH_CPP_EXTENSION_LOGGER = "torch.utils.cpp_extension"


class _SendInstead(logging.Filter):
    def __init__(self, send):
        super().__init__()
        self.send = send

    def filter(self, record):
        if record.levelno < logging.WARNING:
            return True
        self.send(f"{record.levelname.title()}: {record.getMessage()}")
        return False


class RankWarnings:
    """One rank's warnings under torchrun (no launcher of ours collects them): each distinct warning reaches the
    user once. With torchrun's key-value store the first rank to have a warning prints it and the others skip it;
    without one every rank prints its own. Another rank's line names it; known-harmless notices are counted on
    rank 0 only (PRINTER's closing line) unless verbose."""

    def __init__(self, rank: int, store=None, printer: WarningPrinter | None = None):
        self.rank, self.store, self.printer = rank, store, printer or PRINTER
        self.seen: set[str] = set()
        self.run = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def add(self, text: str) -> None:
        if text in self.seen:
            return
        self.seen.add(text)
        if not verbose() and harmless_reason(text):
            if self.rank == 0:
                self.printer.add(text)
            return
        if self.store is not None and not self._first_in_job(text):
            return
        self.printer.add(text if self.rank == 0 else f"rank {self.rank}: {text}")

    def _first_in_job(self, text: str) -> bool:
        key = f"mm_adaptor/warnings/{self.run}/{hashlib.sha1(text.encode()).hexdigest()}"
        try:
            return self.store.add(key, 1) == 1
        except Exception:  # the store is gone (the job is ending): printed twice rather than lost
            return True


def torchrun_store():
    """A client of the store torchrun's agent keeps for its workers (MASTER_ADDR:MASTER_PORT), or None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        from datetime import timedelta

        import torch.distributed as dist

        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=10))
    except Exception:
        return None


def print_every_ranks_warnings_once(rank: int) -> None:
    """Under torchrun: each distinct warning of any rank is printed once (RankWarnings), another rank's line
    prefixed with its rank; not only rank 0's warnings."""
    forward_rank_output(RankWarnings(rank, torchrun_store()).add)


# One printer per process: a job that launches ranks several times (mm-adaptor check) shows each warning once.
PRINTER = WarningPrinter()
