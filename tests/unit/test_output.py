"""What a job prints besides its own lines: each distinct warning once, known-harmless notices in one line."""

import io
import logging
import warnings

from mm_adaptor import output


def test_each_warning_once_and_harmless_notices_summarised(monkeypatch):
    monkeypatch.delenv(output.VERBOSE_ENV, raising=False)
    stream = io.StringIO()
    printer = output.WarningPrinter(stream)
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
    monkeypatch.setenv(output.VERBOSE_ENV, "1")
    stream = io.StringIO()
    printer = output.WarningPrinter(stream)
    printer.add("UserWarning: Apex is not installed. Falling back to Torch Norm")
    printer.close()
    assert stream.getvalue() == "warning: UserWarning: Apex is not installed. Falling back to Torch Norm\n"


def test_a_rank_forwards_python_and_logged_warnings(monkeypatch):
    sent = []
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    root = logging.getLogger()
    handlers = list(root.handlers)
    try:
        output.forward_rank_output(sent.append)
        warnings.warn("careful", UserWarning)
        logging.getLogger("megatron.core.tensor_parallel.random").warning("CPU RNG state changed within GPU RNG context")
        logging.getLogger("megatron.core").info("not a warning")
    finally:
        root.handlers[:] = handlers
    assert sent == ["UserWarning: careful", "Warning: CPU RNG state changed within GPU RNG context"]
