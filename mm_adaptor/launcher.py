"""Start N local ranks on a free port; surface a failing rank's traceback, report a rank that stops making
progress, and stop every rank and everything it started when the launcher is interrupted or dies."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing as mp
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from queue import Empty
from typing import Any, Callable

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def under_launcher() -> bool:
    """True when torchrun (or another launcher) already set the rank environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _forward_warnings_to(queue) -> None:
    """A rank's warnings (Python's and logged ones) go to the launcher, which prints each distinct one once."""
    from mm_adaptor.output import forward_rank_output

    forward_rank_output(queue.put)


def _print_new_warnings(queue) -> None:
    from mm_adaptor.output import PRINTER

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


# ---- inside a rank: die with the launcher, taking everything the rank started along ----

_PR_SET_PDEATHSIG = 1


def _kill_own_group() -> None:
    """Kill this rank's descendants and its process group (itself included)."""
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    except ImportError:
        pass
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _watch_launcher(parent_pid: int, wakeup_fd: int) -> None:
    while True:
        readable, _, _ = select.select([wakeup_fd], [], [], 0.5)
        if readable and signal.SIGTERM in os.read(wakeup_fd, 64):
            _kill_own_group()
        if os.getppid() != parent_pid:
            _kill_own_group()


def _die_with_launcher(launcher_pid: int) -> None:
    """The kernel sends this rank SIGTERM when its parent dies, even by SIGKILL (PR_SET_PDEATHSIG), and a thread
    also watches for a new parent; either kills the rank's process group, so helpers it started (megatron's
    checkpoint writers) die too. The thread reacts to SIGTERM through the wakeup fd, so it acts while the main
    thread is blocked in a collective. The parent is the launcher, or the fork server, which exits with the
    launcher once no rank holds the launcher's end of its liveness pipe (closed here)."""
    os.setpgid(0, 0)
    _release_fork_server()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    parent_pid = os.getppid()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: _kill_own_group())
    signal.set_wakeup_fd(write_fd)
    threading.Thread(target=_watch_launcher, args=(parent_pid, read_fd), name="die-with-launcher",
                     daemon=True).start()
    if not _alive(launcher_pid) or (parent_pid != launcher_pid and not _alive(parent_pid)):
        _kill_own_group()  # it died before the death signal was armed


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _release_fork_server() -> None:
    """A rank forked from the server inherits the launcher's end of the server's liveness pipe; holding it would
    keep the server, and so the rank, alive after the launcher dies."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None and server._forkserver_pid is None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


# ---- how ranks start: forked from a server that imported torch and megatron-core once ----

RANK_START_ENV = "MM_ADAPTOR_RANK_START"  # "fork-server" (the default where the OS can fork) or "spawn"
PRELOAD_MODULE = "mm_adaptor.rank_preload"
# Changed by pytest between tests; nothing a rank reads at import.
_VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)
_server_env: dict[str, str] | None = None


_HELPER_COMMANDS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def is_process_helper(process) -> bool:
    """multiprocessing's resource tracker and the server ranks fork from, which live as long as the launcher's
    process, not as long as its ranks. `process`: a psutil.Process. A rank forked from the server shows the
    server's command line, but is the server's child: not a helper."""
    import psutil

    def helper(p) -> bool:
        with contextlib.suppress(psutil.Error):
            return any(name in " ".join(p.cmdline()) for name in _HELPER_COMMANDS)
        return False

    if not helper(process):
        return False
    with contextlib.suppress(psutil.Error):
        parent = process.parent()
        return parent is None or not helper(parent)
    return True


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _VOLATILE_ENV}


def rank_context():
    """The multiprocessing context ranks start in. A spawned rank imports torch and megatron-core afresh (about 4 s
    of CPU each); a rank forked from the server starts with those imports done, and is still a fresh process. The
    server keeps the environment it started with (what torch and megatron read at import), so when the launcher's
    has changed since (another PYTHONPATH, another device), the server is replaced by one started now. Every rank
    also gets the launcher's environment as it is when it starts."""
    global _server_env
    if os.environ.get(RANK_START_ENV, "fork-server") == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    environment = _environment()
    if environment != _server_env:
        forkserver._forkserver._stop()  # the next rank starts a new one
        mp.set_forkserver_preload([PRELOAD_MODULE])
        _server_env = environment
    return mp.get_context("forkserver")


class _LauncherStdio:
    """The launcher's stdout and stderr as they are when a rank starts (a test's capture, a redirect): a rank
    forked from the server would otherwise write to the server's, which are the launcher's of an earlier time."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _adopt_stdio, (reduction.DupFd(sys.stdout.fileno()), reduction.DupFd(sys.stderr.fileno()))


def _adopt_stdio(out, err) -> None:
    for wrapper, target in ((out, 1), (err, 2)):
        fd = wrapper.detach()
        os.dup2(fd, target)
        os.close(fd)


def _stdio_for(ctx):
    if ctx.get_start_method() != "forkserver":
        return None
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no file behind them (a notebook): the server's
        return None
    return _LauncherStdio()


def _rank_entry(fn, args, rank, world_size, port, threads, errors, rank_warnings, progress, launcher_pid,
                environment, stdio):
    global _progress_slots
    _die_with_launcher(launcher_pid)
    _progress_slots = (progress, rank)
    report_progress("starting")
    _forward_warnings_to(rank_warnings)
    preloaded = sys.modules.get(PRELOAD_MODULE)
    if preloaded is not None:
        preloaded.replay()
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    if threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        import torch

        torch.set_num_threads(threads)
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - everything a rank raises goes to the parent
        errors.put((rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        _end_rank(1)
    report_progress("exiting")
    _end_rank(0)


def _end_rank(code: int) -> None:
    """Exit the rank with `code` once what it sent, started and buffered is out, skipping interpreter teardown.

    Teardown ends with a full garbage collection over torch's and megatron's objects (seconds after the work is
    done), and then extensions' leak checkers run: nanobind's (Triton's bindings) prints a hundred lines about
    objects a rank simply never freed. The OS reclaims the memory; os._exit skips both."""
    from multiprocessing import util

    util._exit_function()  # what multiprocessing does after the target: queue feeders flushed, children joined
    # what the interpreter does next: threading's exit callbacks (a ThreadPoolExecutor's tells its idle workers to
    # stop; joining them without it waits forever), then the join of every non-daemon thread
    threading._shutdown()
    atexit._run_exitfuncs()  # Python-level exit handlers, logging's flush among them
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# The free port is found by binding and releasing it, so another process can take it before rank 0 listens; the
# ranks then fail while rendezvousing, before any work, and start again on a new port.
PORT_ATTEMPTS = 3
_PORT_TAKEN = ("EADDRINUSE", "address already in use")


def launch(fn: Callable[..., Any], args: tuple = (), *, nproc: int, timeout: float | None = None,
           threads_per_rank: int | None = None) -> None:
    """Run fn(*args) in `nproc` spawned ranks. Raises LaunchError if a rank fails or makes no progress
    (report_progress) for `timeout` seconds, Interrupted if the launcher gets SIGINT/SIGTERM/SIGHUP; either way
    every rank and everything it started is gone when it returns or raises."""
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {nproc}")
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // nproc)
    try:
        with _signals_noted() as signals:
            for attempt in range(1, PORT_ATTEMPTS + 1):
                try:
                    return _launch_once(fn, args, nproc, timeout, threads_per_rank, free_port(), signals)
                except LaunchError as exc:
                    if (isinstance(exc, Interrupted) or attempt == PORT_ATTEMPTS
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


def _launch_once(fn, args, nproc, timeout, threads_per_rank, port, signals) -> None:
    ctx = rank_context()
    errors, rank_warnings = ctx.Queue(), ctx.Queue()
    progress = ctx.RawArray("q", 3 * nproc)
    environment = dict(os.environ)
    procs = [
        ctx.Process(target=_rank_entry, name=f"rank{rank}", daemon=False,
                    args=(fn, args, rank, nproc, port, threads_per_rank, errors, rank_warnings, progress, os.getpid(),
                          environment, _stdio_for(ctx)))
        for rank in range(nproc)
    ]
    watch = _ProgressWatch(progress, nproc)
    failed: tuple[int, str, str] | None = None
    try:
        for proc in procs:
            if not signals:
                proc.start()
        while any(_exit_code(p) is None for p in procs) or signals:
            _print_new_warnings(rank_warnings)
            watch.update()
            if signals:
                _kill_ranks(procs)
                raise Interrupted(signals[0], *watch.furthest())
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
        rank, summary, tb = failed
        raise LaunchError(f"rank {rank} failed: {summary}\n--- traceback of rank {rank} ---\n{tb}")


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
