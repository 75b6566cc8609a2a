"""The launcher owns its ranks: a first signal to `mm-adaptor train` lets its ranks finish the iteration and save
(Megatron-LM's exit-signal handler), a second one stops every rank and everything the ranks started with one line,
as does the launcher's own death; a save cut short never becomes the checkpoint a resume loads (Megatron's tracker
file still names the previous save); only a rank that stops making progress is hung."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import warm_python

from mm_adaptor.ranks.launcher import LaunchError, is_process_helper, launch, report_progress
from trainer_runs import QUICK, scalars, train

pytestmark = pytest.mark.distributed

MARKER = "latest_checkpointed_iteration.txt"  # Megatron's tracker file: the iteration a --load resumes
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "1",
        "--nproc-per-node", "2", *QUICK, "--log-interval", "1"]
CHECK_TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
              "--vocab-size", "128", "--nproc-per-node", "2"]
# launch() without a thread count for torch: the ranks need not import it, so they start in well under a second
NO_TORCH = 0


def _start(tmp_path: Path, *extra: str) -> subprocess.Popen:
    """`mm-adaptor train` saving every 2 iterations for far longer than a test waits, in its own session."""
    command = [sys.executable, "-m", "mm_adaptor.cli", "train", *TINY, "--train-iters", "100000",
               "--save", str(tmp_path / "ckpt"), "--save-interval", "2", *extra]
    with open(tmp_path / "stdout", "wb") as out, open(tmp_path / "stderr", "wb") as err:
        return subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True)


def _wait_for(condition, what: str, timeout: float = 180.0, launcher=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        if launcher is not None and launcher.poll() is not None:
            pytest.fail(f"the launcher exited with {launcher.returncode} while waiting for {what}")
        time.sleep(0.01)
    pytest.fail(f"no {what} within {timeout:.0f}s")


def _living(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie nobody reaped has stopped running)."""
    living = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                living.append(process)
        except psutil.NoSuchProcess:
            pass
    return living


def _assert_all_gone(processes: list[psutil.Process], within: float) -> float:
    start = time.monotonic()
    while _living(processes) and time.monotonic() - start < within:
        time.sleep(0.05)
    left = [f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in _living(processes)]
    assert not left, f"still running {within:.0f}s later: {left}"
    return time.monotonic() - start


def _leads_its_group(process: psutil.Process) -> bool:
    """Each rank leads its own process group; a process that ended since it was listed leads none."""
    try:
        return os.getpgid(process.pid) == process.pid
    except ProcessLookupError:
        return False


def _ranks_running(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The launcher's descendants once both ranks are up: ranks, their helpers and the resource tracker."""
    def both_ranks():
        descendants = psutil.Process(launcher.pid).children(recursive=True)
        leaders = [p for p in descendants if _leads_its_group(p)]
        return descendants if len(leaders) == 2 else None

    return _wait_for(both_ranks, "two ranks in their own process groups", launcher=launcher)


@pytest.fixture
def launched(tmp_path):
    """A running `mm-adaptor train`; whatever a failing test leaves is killed afterwards."""
    started: list = []

    def start(*extra):
        launcher = _start(tmp_path, *extra)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        leftovers = [psutil.Process(launcher.pid)] if launcher.poll() is None else []
        for process in leftovers + getattr(launcher, "descendants", []):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                process.kill()
            except psutil.Error:
                pass
        launcher.wait()


def _saved(tmp_path: Path) -> int:
    """0 until Megatron's tracker names an iteration; it opens the file before writing it, so it can be empty."""
    marker = tmp_path / "ckpt" / MARKER
    text = marker.read_text().strip() if marker.exists() else ""
    return int(text) if text else 0


def _iterations_logged(tmp_path: Path) -> list[int]:
    return [int(n) for n in re.findall(r" iteration +(\d+)/", (tmp_path / "stdout").read_text())]


# SIGHUP, the same handler (STOP_SIGNALS): the first signal of the save-cut-short test; a signal to the launcher
# alone: SIGTERM in tests/train/test_trainer_runs.py and the second-signal tests here
@pytest.mark.parametrize("signum, to_group", [(signal.SIGINT, True)], ids=["SIGINT-to-group"])
def test_a_first_signal_finishes_the_iteration_saves_and_exits_0(tmp_path, launched, signum, to_group):
    """(SIGTERM sent to the command in its own process: tests/train/test_trainer_runs.py, with the resume.)"""
    launcher = launched()
    _wait_for(lambda: _saved(tmp_path), "checkpoint", launcher=launcher)
    launcher.descendants = descendants = _ranks_running(launcher)
    (os.killpg if to_group else os.kill)(launcher.pid, signum)  # to the group: what Ctrl-C in a terminal does

    assert launcher.wait(timeout=120) == 0, (tmp_path / "stderr").read_text()[-3000:]
    _assert_all_gone(descendants, within=5)
    stderr = (tmp_path / "stderr").read_text()
    assert "Traceback" not in stderr, stderr
    name = signal.Signals(signum).name
    assert (f"mm-adaptor train: stopped on {name}: the ranks finished their iteration; the checkpoint is in "
            f"{tmp_path / 'ckpt'}") in stderr.splitlines(), stderr
    last = max(_iterations_logged(tmp_path))
    assert _saved(tmp_path) == last and (tmp_path / "ckpt" / f"iter_{last:07d}").is_dir(), (last, _saved(tmp_path))


# SIGHUP then SIGTERM: the save-cut-short test's launcher, with these assertions (one launcher, both checks)
@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGINT)], ids=["SIGTERM-then-SIGINT"])
def test_a_second_signal_stops_every_rank_with_one_line(tmp_path, launched, first, second):
    launcher = launched()
    _wait_for(lambda: _saved(tmp_path), "checkpoint", launcher=launcher)
    launcher.descendants = descendants = _ranks_running(launcher)
    for rank in [p for p in descendants if _leads_its_group(p)]:
        os.killpg(rank.pid, signal.SIGSTOP)  # the ranks cannot finish before the second signal comes
    os.kill(launcher.pid, first)
    time.sleep(0.5)
    os.kill(launcher.pid, second)

    _assert_stopped_with_one_line(tmp_path, launcher, descendants, second)


def _assert_stopped_with_one_line(tmp_path: Path, launcher, descendants, second: int) -> None:
    assert launcher.wait(timeout=30) == 128 + second
    _assert_all_gone(descendants, within=5)
    stderr = (tmp_path / "stderr").read_text()
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and stderr.splitlines()[-1] == lines[0], "the interruption is the last word"
    assert lines[0].startswith(f"mm-adaptor train: interrupted ({signal.Signals(second).name}) at iteration "), lines
    assert lines[0].endswith(f"; last checkpoint: {tmp_path / 'ckpt' / f'iter_{_saved(tmp_path):07d}'}"), lines[0]


def test_ranks_and_their_helpers_die_with_a_killed_launcher(tmp_path, launched):
    launcher = launched()
    _wait_for(lambda: _saved(tmp_path), "checkpoint", launcher=launcher)
    launcher.descendants = descendants = _ranks_running(launcher)
    launcher.kill()
    launcher.wait()
    _assert_all_gone(descendants, within=5)


def _stopped(process: psutil.Process) -> bool:
    try:
        return process.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _stop_ranks_mid_save(tmp_path: Path, launcher) -> int:
    """Freeze every rank (and its helpers) while a save is half done; returns the iteration being saved.

    Megatron writes iter_N and moves its tracker file to N once every rank has written its part, so an iter_N
    newer than the tracker seen while all ranks are stopped is a save that has not finished."""
    ckpt = tmp_path / "ckpt"

    def unfinished():
        newest = max((int(p.name[len("iter_"):]) for p in ckpt.glob("iter_*")), default=0)
        return newest if newest > _saved(tmp_path) else None

    while True:
        newest = _wait_for(unfinished, "save in progress", launcher=launcher)
        ranks = [p for p in psutil.Process(launcher.pid).children(recursive=True) if _leads_its_group(p)]
        for rank in ranks:
            os.killpg(rank.pid, signal.SIGSTOP)
        group = [p for rank in ranks for p in [rank, *rank.children(recursive=True)]]
        _wait_for(lambda group=group: all(_stopped(p) for p in group), "stopped ranks")
        if _saved(tmp_path) < newest:
            return newest
        for rank in ranks:
            os.killpg(rank.pid, signal.SIGCONT)


def test_a_save_cut_short_leaves_the_previous_checkpoint_to_resume_from(tmp_path, launched):
    launcher = launched("--tensorboard-dir", str(tmp_path / "tb-cut"))
    _wait_for(lambda: _saved(tmp_path), "checkpoint", launcher=launcher)
    launcher.descendants = descendants = _ranks_running(launcher)
    cut_short = _stop_ranks_mid_save(tmp_path, launcher)
    os.kill(launcher.pid, signal.SIGHUP)  # passed on to the stopped ranks, which cannot act on it
    time.sleep(0.5)
    launcher.terminate()
    _assert_stopped_with_one_line(tmp_path, launcher, descendants, signal.SIGTERM)

    ckpt = tmp_path / "ckpt"
    saved = _saved(tmp_path)
    assert saved == cut_short - 2, f"the tracker names {saved}, the save cut short was {cut_short}"
    assert f"last checkpoint: {ckpt / f'iter_{saved:07d}'}" in (tmp_path / "stderr").read_text()

    target = cut_short + 1
    # the schedule's length must match the checkpoint's (Megatron checks it); --exit-interval ends the run
    resumed = train([*TINY, "--train-iters", "100000", "--exit-interval", str(target), "--load", str(ckpt),
                     "--save", str(ckpt),
                     "--save-interval", "2", "--tensorboard-dir", str(tmp_path / "tb-resumed")])
    assert resumed.status == 0, resumed.err[-3000:]
    before, after = scalars(tmp_path / "tb-cut"), scalars(tmp_path / "tb-resumed")
    assert sorted(after) == list(range(saved + 1, target + 1)), sorted(after)
    # the iterations both ran (the cut-short run logged the one it was saving) are the same, bit for bit
    assert {step: before[step] for step in after if step in before} == {
        step: after[step] for step in after if step in before}
    assert saved + 1 in before
    # the resumed run saved the cut-short iteration again over the leftovers, then its last one
    assert (ckpt / f"iter_{cut_short:07d}").is_dir() and _saved(tmp_path) == target


def _record_pid(directory):
    Path(directory, os.environ["RANK"]).write_text(str(os.getpid()))


def _progress_then_stall(directory, phase):
    """Both ranks train, then stop reporting in `phase`: rank 1 at iteration 3 and rank 0 one step further (as if
    blocked in a collective rank 1 never reached)."""
    _record_pid(directory)
    stall_at = 3 if os.environ["RANK"] == "1" else 4
    for iteration in range(1, stall_at):
        report_progress("training", iteration)
        time.sleep(0.1)
    report_progress(phase, stall_at)
    time.sleep(120)


def _rank_processes(directory) -> list[psutil.Process]:
    processes = []
    for path in Path(directory).iterdir():
        try:
            processes.append(psutil.Process(int(path.read_text())))
        except psutil.NoSuchProcess:
            pass
    return processes


@pytest.mark.parametrize("phase", ["training", "saving", "teardown"])
def test_ranks_that_stop_progressing_are_named_with_their_phase(tmp_path, phase):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_progress_then_stall, (str(tmp_path), phase), nproc=2, timeout=3, threads_per_rank=NO_TORCH)
    message = str(info.value)
    assert "rank(s) 0, 1 still running with no progress for 3s" in message, message
    if phase == "teardown":
        assert "(rank 0 in teardown; rank 1 in teardown)" in message, message
    else:
        assert f"(rank 0 in {phase} at iteration 4; rank 1 in {phase} at iteration 3)" in message, message
    assert ("disagree on the layout" in message) == (phase == "training"), message
    assert time.monotonic() - start < 60
    _assert_all_gone(_rank_processes(tmp_path), within=5)


def _slow_but_steady(directory, steps, seconds_per_step):
    _record_pid(directory)
    for iteration in range(1, steps + 1):
        report_progress("training", iteration)
        time.sleep(seconds_per_step)


def test_a_slow_rank_that_keeps_progressing_is_not_hung(tmp_path):
    start = time.monotonic()
    launch(_slow_but_steady, (str(tmp_path), 6, 1.0), nproc=2, timeout=2.5, threads_per_rank=NO_TORCH)
    assert time.monotonic() - start > 2.5 * 2, "the run must outlast the timeout for the test to mean anything"
    _assert_all_gone(_rank_processes(tmp_path), within=5)


def test_an_interrupted_check_stops_its_ranks_with_one_line(tmp_path, native_ops_built):
    command = [sys.executable, "-m", "mm_adaptor.cli", "check", "--optimize-vocab-parallel-ce", "--layout", "tp2",
               "--iters", "100000", "--no-baseline-cache", *CHECK_TINY]
    with open(tmp_path / "stderr", "wb") as err:
        check = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        descendants = _ranks_running(check)
        check.send_signal(signal.SIGINT)
        assert check.wait(timeout=30) == 130
        _assert_all_gone(descendants, within=5)
    finally:
        if check.poll() is None:
            check.kill()
            check.wait()
    stderr = (tmp_path / "stderr").read_text().splitlines()
    assert len(stderr) == 1 and stderr[0].startswith("mm-adaptor check: interrupted (SIGINT) "), stderr


_LIBRARY_CALLER = """
import signal
import sys
import time

from mm_adaptor.ranks.launcher import launch

# as in a terminal: a suite started in the background (nohup ... &) hands its children SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)


def sleep():
    time.sleep(600)


if __name__ == "__main__":
    try:
        launch(sleep, nproc=2, timeout=600, threads_per_rank=0)
    except KeyboardInterrupt:
        sys.exit(3)
"""


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 3), (signal.SIGTERM, -signal.SIGTERM)],
                         ids=["SIGINT-raises-KeyboardInterrupt", "SIGTERM-terminates"])
def test_a_library_caller_gets_the_signal_s_own_effect_once_the_ranks_are_gone(tmp_path, signum, status):
    """Outside the mm-adaptor commands (a test session, a user's script) a signal keeps its meaning."""
    script = tmp_path / "caller.py"
    script.write_text(_LIBRARY_CALLER)
    caller = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    try:
        descendants = _ranks_running(caller)
        caller.send_signal(signum)
        assert caller.wait(timeout=30) == status
        _assert_all_gone(descendants, within=5)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()


def test_the_launcher_leaves_no_process_behind():
    """Run last in this module: nothing the tests here started is still running (but this process's own
    multiprocessing resource tracker and the server its ranks fork from, which live as long as it does, and the
    tests' warm interpreters)."""
    left = [f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in _living(psutil.Process().children(recursive=True))
            if not is_process_helper(p) and p.pid not in warm_python.server_pids()]
    assert not left, left
