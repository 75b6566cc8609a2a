"""Start N local ranks on a free port; surface a failing rank's traceback, report a rank that stops making
progress, and stop every rank and everything it started when the launcher is interrupted or dies."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from queue import Empty
from dataclasses import dataclass
from typing import Any, Callable

from mm_adaptor.ranks.process import (PRELOAD_MODULE, die_with_launcher, exit_skipping_teardown, free_port,
                                     is_process_helper, rank_context, stdio_for, write_whole_lines)

__all__ = ["LaunchError", "Interrupted", "Nodes", "launch", "free_port", "under_launcher", "report_progress",
           "report_interruptions", "is_process_helper", "rank_context"]

RANK_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# What a rank is doing, as it last told the launcher (report_progress).
PHASES = ("starting", "building", "training", "saving", "teardown", "exiting")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class LaunchError(RuntimeError):
    """A rank died, raised, or hung; the message carries its traceback or names the hung ranks."""


class Interrupted(LaunchError):
    """The launcher got SIGINT, SIGTERM or SIGHUP and stopped every rank; says where the ranks were."""

    def __init__(self, signum: int, phase: str, iteration: int):
        self.signum, self.phase, self.iteration = signum, phase, iteration
        super().__init__(f"interrupted ({self.signal_name}) {self.where}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def where(self) -> str:
        if self.phase in ("training", "saving") or self.iteration:
            return f"at iteration {self.iteration}"
        return f"while {self.phase}"

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def under_launcher() -> bool:
    """True when torchrun (or another launcher) already set the rank environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _forward_warnings_to(queue) -> None:
    """A rank's warnings (Python's and logged ones) go to the launcher, which prints each distinct one once."""
    from mm_adaptor.ranks.warning_digest import forward_rank_output

    forward_rank_output(queue.put)


def _print_new_warnings(queue) -> None:
    from mm_adaptor.ranks.warning_digest import PRINTER

    while True:
        try:
            text = queue.get_nowait()
        except Empty:
            return
        PRINTER.add(text)


# ---- progress: each rank owns three slots of a shared array (beats, phase, iteration) ----

_progress_slots = None  # (array, rank) inside a rank started by launch()


def report_progress(phase: str, iteration: int | None = None) -> None:
    """In a rank started by launch(): tell the launcher it is alive and what it is doing (a PHASES name and the
    iteration it works on; None keeps the last one). A rank silent for the launch timeout is declared hung.
    Elsewhere (torchrun, one process) a no-op."""
    if _progress_slots is None:
        return
    array, rank = _progress_slots
    array[3 * rank + 1] = PHASES.index(phase)
    if iteration is not None:
        array[3 * rank + 2] = iteration
    array[3 * rank] += 1


class _ProgressWatch:
    """The launcher's view of the ranks' progress, timed by its own clock."""

    def __init__(self, array, nproc: int):
        self.array, self.nproc = array, nproc
        self.beats = [-1] * nproc
        self.since = [time.monotonic()] * nproc

    def update(self) -> None:
        now = time.monotonic()
        for rank in range(self.nproc):
            beats = self.array[3 * rank]
            if beats != self.beats[rank]:
                self.beats[rank], self.since[rank] = beats, now

    def where(self, rank: int) -> tuple[str, int]:
        return PHASES[self.array[3 * rank + 1]], self.array[3 * rank + 2]

    def silent_for(self, rank: int) -> float:
        return time.monotonic() - self.since[rank]

    def furthest(self) -> tuple[str, int]:
        """The phase and iteration of the rank that got furthest."""
        return max((self.where(rank) for rank in range(self.nproc)), key=lambda w: (w[1], PHASES.index(w[0])))


def _hang_message(watch: _ProgressWatch, hung: list[int], timeout: float) -> str:
    places = []
    for rank in hung:
        phase, iteration = watch.where(rank)
        places.append(f"rank {rank} in {phase}" + (f" at iteration {iteration}" if phase in ("training", "saving")
                                                    else ""))
    message = (f"timed out after {timeout:.0f}s: rank(s) {', '.join(map(str, hung))} still running with no "
               f"progress for {timeout:.0f}s ({'; '.join(places)})")
    if all(watch.where(rank)[0] == "training" for rank in hung):
        message += ("; a hang in a collective during training usually means the ranks disagree on the layout or "
                    "one rank skipped a communication")
    return message


@dataclass(frozen=True)
class Nodes:
    """Where this launcher's ranks sit in the job: `count` nodes of `nproc` ranks each, this one `rank`, node 0 at
    addr:port (port None: a free local one, one node only)."""
    count: int = 1
    rank: int = 0
    addr: str = "127.0.0.1"
    port: int | None = None


def _rank_entry(fn, args, local_rank, nproc, nodes, port, threads, errors, rank_warnings, progress, launcher_pid,
                environment, stdio, graceful):
    global _progress_slots
    die_with_launcher(launcher_pid, graceful)
    write_whole_lines()
    _progress_slots = (progress, local_rank)
    report_progress("starting")
    _forward_warnings_to(rank_warnings)
    preloaded = sys.modules.get(PRELOAD_MODULE)
    if preloaded is not None:
        preloaded.replay(rank_warnings.put)
    os.environ.clear()
    os.environ.update(environment)
    rank = nodes.rank * nproc + local_rank
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nodes.count * nproc),
        LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(nodes.rank), MASTER_ADDR=nodes.addr, MASTER_PORT=str(port),
    )
    if threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        import torch

        torch.set_num_threads(threads)
    try:
        fn(*args)
    except SystemExit as exc:  # a clean exit (Megatron's exit conditions call sys.exit(0)) is not a failure
        if exc.code not in (0, None):
            errors.put((rank, f"SystemExit: {exc.code}", traceback.format_exc()))
            exit_skipping_teardown(exc.code if isinstance(exc.code, int) else 1)
    except BaseException as exc:  # noqa: BLE001 - everything a rank raises goes to the parent
        errors.put((rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        exit_skipping_teardown(1)
    report_progress("exiting")
    exit_skipping_teardown(0)


# The free port is found by binding and releasing it, so another process can take it before rank 0 listens; the
# ranks then fail while rendezvousing, before any work, and start again on a new port.
PORT_ATTEMPTS = 3
_PORT_TAKEN = ("EADDRINUSE", "address already in use")


def launch(fn: Callable[..., Any], args: tuple = (), *, nproc: int, timeout: float | None = None,
           threads_per_rank: int | None = None, nodes: Nodes = Nodes(), graceful: bool = False) -> int | None:
    """Run fn(*args) in `nproc` spawned ranks (of `nodes`). Raises LaunchError if a rank fails or makes no progress
    (report_progress) for `timeout` seconds, Interrupted if the launcher gets SIGINT/SIGTERM/SIGHUP; either way
    every rank and everything it started is gone when it returns or raises.

    `graceful`: the first such signal is passed on to the ranks as SIGTERM, for them to finish (the trainer saves
    a checkpoint and exits 0); launch then returns the signal's number once they have, and a second signal stops
    them as before. Returns None when no signal came."""
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {nproc}")
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // nproc)
    attempts = PORT_ATTEMPTS if nodes.port is None else 1  # a given port is the job's: nothing to retry on
    try:
        with _signals_noted() as signals:
            for attempt in range(1, attempts + 1):
                try:
                    return _launch_once(fn, args, nproc, timeout, threads_per_rank, nodes,
                                        nodes.port or free_port(), signals, graceful)
                except LaunchError as exc:
                    if (isinstance(exc, Interrupted) or attempt == attempts
                            or not any(text in str(exc) for text in _PORT_TAKEN)):
                        raise
    except Interrupted as exc:
        if not _interruptions_reported:
            signal.raise_signal(exc.signum)  # the ranks are gone; now the signal does what it did before
        raise


# The mm-adaptor commands turn a signal into Interrupted (one line, exit 128 + N). Any other caller (a test
# session, a user's script) gets the signal's own effect (KeyboardInterrupt, termination, its own handler) once
# the ranks are stopped, then Interrupted if its handler returns.
_interruptions_reported = False


def report_interruptions() -> None:
    global _interruptions_reported
    _interruptions_reported = True


@contextlib.contextmanager
def _signals_noted():
    """While ranks run, SIGINT, SIGTERM and SIGHUP are noted (the monitoring loop stops the ranks) instead of
    killing the launcher or raising KeyboardInterrupt somewhere in it. Only the main thread can set handlers."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    previous = {signum: signal.signal(signum, lambda signum, frame: noted.append(signum)) for signum in STOP_SIGNALS}
    try:
        yield noted
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _launch_once(fn, args, nproc, timeout, threads_per_rank, nodes, port, signals, graceful) -> int | None:
    ctx = rank_context()
    errors, rank_warnings = ctx.Queue(), ctx.Queue()
    progress = ctx.RawArray("q", 3 * nproc)
    environment = dict(os.environ)
    procs = [
        ctx.Process(target=_rank_entry, name=f"rank{rank}", daemon=False,
                    args=(fn, args, rank, nproc, nodes, port, threads_per_rank, errors, rank_warnings, progress,
                          os.getpid(), environment, stdio_for(ctx), graceful))
        for rank in range(nproc)
    ]
    watch = _ProgressWatch(progress, nproc)
    failed: tuple[int, str, str] | None = None
    passed_on = 0  # signals handed to the ranks (graceful)
    try:
        for proc in procs:
            if not signals:
                proc.start()
        while any(_exit_code(p) is None for p in procs) or len(signals) > passed_on:
            _print_new_warnings(rank_warnings)
            watch.update()
            if len(signals) > passed_on:
                if graceful and passed_on == 0 and any(p.pid is not None for p in procs):
                    _pass_on(procs, signal.SIGTERM)
                    passed_on = 1
                    continue
                _kill_ranks(procs)
                raise Interrupted(signals[-1], *watch.furthest())
            failed = _first_failure(procs, errors)
            if failed is not None:
                _kill_ranks(procs, grace=5.0)
                break
            running = [rank for rank, proc in enumerate(procs) if _exit_code(proc) is None]
            # Hung: no running rank made progress for `timeout` (a rank stuck alone soon blocks the others).
            if timeout is not None and running and all(watch.silent_for(rank) > timeout for rank in running):
                _kill_ranks(procs)
                raise LaunchError(_hang_message(watch, running, timeout))
            time.sleep(0.05)
        if failed is None:
            failed = _first_failure(procs, errors)
    finally:
        _kill_ranks(procs)  # anything a finished rank left behind, or every rank on an unexpected error
        _print_new_warnings(rank_warnings)
    if failed is not None:
        if passed_on:  # a rank that had not yet taken over SIGTERM was stopped by it
            raise Interrupted(signals[0], *watch.furthest())
        rank, summary, tb = failed
        error = LaunchError(f"rank {rank} failed: {summary}\n--- traceback of rank {rank} ---\n{tb}")
        error.summary = summary  # "<exception type>: <message>"
        raise error
    return signals[0] if passed_on else None


def _pass_on(procs, signum) -> None:
    """The signal to each running rank itself (not its group: its helpers are its to stop)."""
    for proc in procs:
        if proc.pid is not None and _exit_code(proc) is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signum)


def _first_failure(procs, errors):
    if not errors.empty():
        return errors.get()
    for rank, proc in enumerate(procs):
        code = _exit_code(proc)
        if code not in (None, 0):
            time.sleep(0.2)  # give its traceback a moment to arrive
            if not errors.empty():
                return errors.get()
            return rank, f"exited with code {code} without a Python traceback (killed or crashed)", ""
    return None


# A spawned rank is reaped only by _kill_ranks: until then its pid, which is also its process group's id, cannot be
# taken by another process, so killing that group reaches only what the rank started. A rank forked from the server
# is the server's child, reaped there as it exits; its group id stays taken while anything it started lives.

def _is_child(proc) -> bool:
    return proc._popen is not None and proc._popen.__class__.__module__.endswith("popen_spawn_posix")


def _reaped(proc) -> bool:
    if not _is_child(proc):
        return proc.exitcode is not None
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return False


def _exit_code(proc) -> int | None:
    """The rank's exit code (minus the signal that killed it), None while it runs; leaves a child unreaped."""
    if proc.pid is None:
        return None
    if not _is_child(proc):
        return proc.exitcode
    try:
        status = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.exitcode
    if status is None:
        return None
    return status.si_status if status.si_code == os.CLD_EXITED else -status.si_status


def _kill_ranks(procs, grace: float = 0.0) -> None:
    """After `grace` seconds for the ranks to exit on their own, kill each rank's process group and every
    descendant (collected first: a helper whose rank is dead is no longer its descendant)."""
    import psutil

    end = time.monotonic() + grace
    while grace and any(_exit_code(p) is None for p in procs) and time.monotonic() < end:
        time.sleep(0.05)
    started = [proc for proc in procs if proc.pid is not None]
    unreaped = [proc for proc in started if not _reaped(proc)]
    victims = []
    for proc in unreaped:
        with contextlib.suppress(psutil.Error):
            victims += psutil.Process(proc.pid).children(recursive=True)
    for proc in started:
        if proc in unreaped or not _is_child(proc):  # a forked rank's group outlives it while its helpers live
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its group: the rank made itself leader at start
        if proc in unreaped:
            proc.kill()  # in case it had not got that far
    for victim in victims:
        with contextlib.suppress(psutil.Error):
            victim.kill()
    for proc in unreaped:
        proc.join(timeout=5.0)
    psutil.wait_procs(victims, timeout=5.0)
