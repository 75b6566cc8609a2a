"""What a job prints besides its own lines: each distinct warning once, known-harmless notices in one line."""

import io
import logging
import warnings

from mm_adaptor.ranks import warning_digest
def test_each_warning_once_and_harmless_notices_summarised(monkeypatch):
    monkeypatch.delenv(warning_digest.VERBOSE_ENV, raising=False)
    stream = io.StringIO()
    printer = warning_digest.WarningPrinter(stream)
    for _ in range(3):
        printer.add("UserWarning: Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
        printer.add("UserWarning: Apex is not installed. Falling back to Torch Norm")
        printer.add("UserWarning: something the user must see")
    printer.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "warning: UserWarning: something the user must see"
    assert len(lines) == 2 and lines[1].startswith("note: 2 known-harmless library notices not shown")
    assert "--verbose" in lines[1]


def test_verbose_shows_everything(monkeypatch):
    monkeypatch.setenv(warning_digest.VERBOSE_ENV, "1")
    stream = io.StringIO()
    printer = warning_digest.WarningPrinter(stream)
    printer.add("UserWarning: Apex is not installed. Falling back to Torch Norm")
    printer.close()
    assert stream.getvalue() == "warning: UserWarning: Apex is not installed. Falling back to Torch Norm\n"


def test_a_rank_forwards_python_and_logged_warnings(monkeypatch):
    sent = []
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    root = logging.getLogger()
    handlers = list(root.handlers)
    try:
        warning_digest.forward_rank_output(sent.append)
        warnings.warn("careful", UserWarning, stacklevel=1)
        rng_logger = logging.getLogger("megatron.core.tensor_parallel.random")
        rng_logger.warning("CPU RNG state changed within GPU RNG context")
        logging.getLogger("megatron.core").info("not a warning")
    finally:
        root.handlers[:] = handlers
    assert sent == ["UserWarning: careful", "Warning: CPU RNG state changed within GPU RNG context"]


class _SharedStore:
    """torchrun's key-value store, as far as RankWarnings uses it."""

    def __init__(self):
        self.counts = {}

    def add(self, key, amount):
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]


def _printer(monkeypatch):
    monkeypatch.delenv(warning_digest.VERBOSE_ENV, raising=False)
    stream = io.StringIO()
    return warning_digest.WarningPrinter(stream), stream


def test_each_ranks_warnings_reach_the_user_once_through_the_shared_store(monkeypatch):
    printer, stream = _printer(monkeypatch)
    store = _SharedStore()
    ranks = [warning_digest.RankWarnings(rank, store, printer) for rank in range(3)]
    for rank, warned in enumerate(ranks):
        for _ in range(2):
            warned.add("UserWarning: said by every rank")
            warned.add(f"UserWarning: said by rank {rank} only")
            warned.add("UserWarning: Apex is not installed. Falling back to Torch Norm")
    printer.close()
    assert stream.getvalue().splitlines() == [
        "warning: UserWarning: said by every rank",
        "warning: UserWarning: said by rank 0 only",
        "warning: rank 1: UserWarning: said by rank 1 only",
        "warning: rank 2: UserWarning: said by rank 2 only",
        "note: 1 known-harmless library notice not shown (without Transformer Engine/Apex megatron uses its torch "
        "implementations); --verbose shows them",
    ]


def test_without_a_store_another_rank_prints_its_own_warnings(monkeypatch):
    printer, stream = _printer(monkeypatch)
    warned = warning_digest.RankWarnings(1, None, printer)
    warned.add("UserWarning: careful")
    warned.add("UserWarning: careful")
    assert stream.getvalue() == "warning: rank 1: UserWarning: careful\n"


TORCHRUN_SCRIPT = """
import os, warnings
from mm_adaptor.ranks import warning_digest
rank = int(os.environ["RANK"])
warnings.simplefilter("always")
warning_digest.print_every_ranks_warnings_once(rank)
warnings.warn("said by every rank")
warnings.warn(f"said by rank {rank} only")
warnings.warn("said by every rank")
"""


def test_under_torchrun_every_ranks_distinct_warnings_are_printed_once(tmp_path):
    import subprocess
    import sys

    from mm_adaptor.ranks.launcher import free_port

    script = tmp_path / "warn.py"
    script.write_text(TORCHRUN_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(script)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert sorted(lines) == ["warning: UserWarning: said by every rank", "warning: UserWarning: said by rank 0 only",
                             "warning: rank 1: UserWarning: said by rank 1 only"] or sorted(lines) == [
        "warning: UserWarning: said by rank 0 only", "warning: rank 1: UserWarning: said by every rank",
        "warning: rank 1: UserWarning: said by rank 1 only"], done.stderr


def test_a_command_that_is_a_rank_forwards_each_warning_once(monkeypatch):
    """Under torchrun the command's own forwarding hands over to the rank's: a logged warning reaches one sender."""
    import logging

    monkeypatch.delenv(warning_digest.VERBOSE_ENV, raising=False)
    root = logging.getLogger()
    handlers, show = list(root.handlers), warnings.showwarning
    sent = []
    try:
        with warning_digest.own_warnings_as_the_ranks():
            warning_digest.forward_rank_output(sent.append)
            logging.getLogger("megatron.core").warning("said once")
    finally:
        root.handlers[:] = handlers
        warnings.showwarning = show
    assert sent == ["Warning: said once"]
    assert "Warning: said once" not in warning_digest.PRINTER.shown, "the command's forwarding printed it too"
