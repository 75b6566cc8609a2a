"""What `mm-adaptor train` and `mm-adaptor check` print by default: the README's lines, no Python warning text
(the known-harmless library notices are counted in one `note:` line), and everything with --verbose."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("native_ops_built")]  # the build's own lines

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "128"]
ITERATION_LINE = re.compile(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\] iteration +\d+/ +\d+ \| consumed samples:")
NOTE_LINE = re.compile(r"^note: \d+ known-harmless library notices? not shown \(.*\); --verbose shows them$")
WARNING_TEXT = re.compile(r"Warning|warning:|warnings\.warn|Traceback")
# Megatron's fusions compile in each rank (about 9 s of CPU a run, far more from a cold cache): the first test's
# default run shows what they print; the runs about the warnings' routing go without them
NO_FUSIONS = ["--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion"]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    # as a user runs it: the suite's PYTHONWARNINGS=ignore (tests/conftest.py) would hide what is being tested
    env = {key: value for key, value in os.environ.items() if key not in ("MM_ADAPTOR_VERBOSE", "PYTHONWARNINGS")}
    return subprocess.run([sys.executable, "-m", "mm_adaptor.cli", *argv], capture_output=True, text=True,
                          timeout=600, env=env)


def test_train_prints_megatron_s_lines_and_no_warning_text():
    done = _cli("train", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                "--train-iters", "2", "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", *TINY)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    banner = [line for line in lines if line.startswith("> mm_adaptor trainer: gpt; features: none; ")]
    assert banner == ["> mm_adaptor trainer: gpt; features: none; trainable 19,104 of 19,104 parameters (100.00%) "
                      "on this rank"], done.stdout[-3000:]
    iterations = [line for line in lines if ITERATION_LINE.match(line)]
    assert [line.split("|")[0].split("iteration")[1].split()[0] for line in iterations] == ["1/", "2/"], iterations
    assert any(line.startswith(" validation loss at iteration 2 |") for line in lines), done.stdout[-3000:]
    assert not WARNING_TEXT.search(done.stdout + done.stderr), done.stderr
    stderr = done.stderr.splitlines()
    assert len(stderr) == 1 and NOTE_LINE.match(stderr[0]), stderr


def test_verbose_shows_each_warning_once():
    done = _cli("train", "--train-iters", "1", "--eval-iters", "1", "--verbose", *TINY, *NO_FUSIONS)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert any("Transformer Engine and Apex are not installed" in line for line in warnings), done.stderr
    assert len(warnings) == len(set(warnings)), "two ranks, each warning printed once"
    assert not any(NOTE_LINE.match(line) for line in done.stderr.splitlines())


def test_check_prints_no_warning_text():
    done = _cli("check", "--optimize-vocab-parallel-ce", "--layout", "tp2", "--iters", "1", *TINY)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0].startswith("check --optimize-vocab-parallel-ce | layout tp2"), done.stdout
    assert "verdict: PASS" in done.stdout
    assert not WARNING_TEXT.search(done.stdout + done.stderr), done.stdout + done.stderr
    stderr = done.stderr.splitlines()
    assert len(stderr) == 1 and NOTE_LINE.match(stderr[0]), stderr


def test_under_torchrun_each_warning_of_any_rank_is_printed_once():
    from mm_adaptor.ranks.launcher import free_port

    env = {key: value for key, value in os.environ.items() if key not in ("MM_ADAPTOR_VERBOSE", "PYTHONWARNINGS")}
    env.update(MM_ADAPTOR_DEVICE="cpu", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "mm_adaptor.cli", "train", "--train-iters", "1", "--eval-iters", "0", *TINY,
               *NO_FUSIONS]
    # (no evaluation: Megatron switches its rerun state machine's mode for it and back, the same notice twice)
    quiet = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert quiet.returncode == 0, quiet.stderr
    assert any(ITERATION_LINE.match(line) for line in quiet.stdout.splitlines()), quiet.stdout[-3000:]
    assert not WARNING_TEXT.search(quiet.stdout + quiet.stderr), quiet.stderr
    assert [line for line in quiet.stderr.splitlines() if NOTE_LINE.match(line)], "rank 0 counts what it hid"
    loud = subprocess.run([*command, "--verbose"], capture_output=True, text=True, timeout=600, env=env)
    shown = [line for line in loud.stderr.splitlines() if line.startswith("warning: ")]
    assert any("Transformer Engine and Apex are not installed" in line for line in shown), loud.stderr
    texts = [re.sub(r"^warning: (rank \d+: )?", "", line) for line in shown]
    assert len(texts) == len(set(texts)), "each warning once across the ranks"


def test_report_counts_megatron_s_import_warnings_as_train_does():
    done = _cli("report")
    assert done.returncode == 0, done.stderr
    assert not WARNING_TEXT.search(done.stderr), done.stderr
    stderr = done.stderr.splitlines()
    assert len(stderr) == 1 and NOTE_LINE.match(stderr[0]), stderr
    assert "Transformer Engine/Apex" in stderr[0], "megatron's import-time notices were not the ones counted"
    verbose = _cli("report", "--verbose")
    assert "warning: UserWarning: Transformer Engine and Apex are not installed" in verbose.stderr, verbose.stderr
