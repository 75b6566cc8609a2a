"""How a rank process begins and ends: forked from a server that imported torch and megatron-core once (or
spawned), with the launcher's environment and stdio; tied to the launcher so that it, and everything it started, dies
with it; and its exit once its output is out."""

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
import weakref

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def own_rendezvous():
    """MASTER_ADDR/MASTER_PORT on a free local port for a process group of this process alone; the caller's values
    come back afterwards."""
    saved = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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


def _watch_launcher(parent_pid: int, wakeup_fd: int, graceful: bool) -> None:
    while True:
        readable, _, _ = select.select([wakeup_fd], [], [], 0.5)
        if readable and signal.SIGTERM in os.read(wakeup_fd, 64) and not graceful:
            _kill_own_group()
        if os.getppid() != parent_pid:
            _kill_own_group()


def die_with_launcher(launcher_pid: int, graceful: bool = False) -> None:
    """The kernel sends this rank SIGTERM when its parent dies, even by SIGKILL (PR_SET_PDEATHSIG), and a thread
    also watches for a new parent; either kills the rank's process group, so helpers it started (megatron's
    checkpoint writers) die too. The thread reacts to SIGTERM through the wakeup fd, so it acts while the main
    thread is blocked in a collective. The parent is the launcher, or the fork server, which exits with the
    launcher once no rank holds the launcher's end of its liveness pipe (closed here). `graceful`: SIGTERM is the
    rank's to handle once it installs a handler (the trainer saves and exits); until then it kills as before, and
    the launcher's death still kills the group."""
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
    threading.Thread(target=_watch_launcher, args=(parent_pid, read_fd, graceful), name="die-with-launcher",
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
PRELOAD_MODULE = "mm_adaptor.ranks.preload"
# What torch and megatron-core do not read at import, so a change needs no new server (the rank gets the current
# value anyway): mm_adaptor's own settings (read by its code in the rank, e.g. the harness's extra feature modules),
# the rendezvous, pytest's per-test marker, and inductor's cache folder (torch writes its default there on first use).
_NOT_READ_AT_IMPORT = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                       "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
_NOT_READ_AT_IMPORT_PREFIXES = ("MM_ADAPTOR_",)
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
    return {k: v for k, v in os.environ.items()
            if k not in _NOT_READ_AT_IMPORT and not k.startswith(_NOT_READ_AT_IMPORT_PREFIXES)}


def _ranks_run_on_cuda() -> bool:
    """CUDA ranks are spawned: megatron-core's imports ask torch.cuda.is_available() at module level, which registers
    torch's fork guard in the server, and a rank forked from it then cannot initialise CUDA (seen on an H100)."""
    forced = os.environ.get("MM_ADAPTOR_DEVICE", "").strip().lower()  # devices.DEVICE_ENV (ranks/ sits below devices/)
    if forced:
        return forced == "cuda"
    if "torch" not in sys.modules and not _gpu_device_nodes():
        return False  # what torch would answer, without its import (about 3 s of CPU in a launcher)
    import torch

    return torch.cuda.is_available()


DEVICE_NODES = "/dev"
# NVIDIA's driver (nvidia0, nvidiactl), Jetson's (nvhost-*, nvgpu), WSL's (dxg), ROCm's (kfd): any of them, and torch
# is asked
_GPU_NODE_PREFIXES = ("nvidia", "nvhost", "nvgpu", "dxg", "kfd")


def _gpu_device_nodes() -> list[str]:
    try:
        names = os.listdir(DEVICE_NODES)
    except OSError:
        return ["(unreadable)"]
    return [name for name in names if name.startswith(_GPU_NODE_PREFIXES)]


def rank_context():
    """The multiprocessing context ranks start in. A spawned rank imports torch and megatron-core afresh (about 4 s
    of CPU each); a rank forked from the server starts with those imports done, and is still a fresh process. The
    server keeps the environment it started with (what torch and megatron read at import), so when the launcher's
    has changed since (another PYTHONPATH, another device), the server is replaced by one started now. Every rank
    also gets the launcher's environment as it is when it starts. Ranks on CUDA are spawned (_ranks_run_on_cuda)."""
    global _server_env
    if (os.environ.get(RANK_START_ENV, "fork-server") == "spawn" or "forkserver" not in mp.get_all_start_methods()
            or _ranks_run_on_cuda()):
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    environment = _environment()
    if environment != _server_env:
        forkserver._forkserver._stop()  # the next rank starts a new one
        mp.set_forkserver_preload([PRELOAD_MODULE])
        _server_env = environment
    return mp.get_context("forkserver")


def start_rank_server() -> None:
    """Start the server ranks fork from now, where they will be forked from it: its imports (torch, megatron-core,
    several seconds) then run beside the launcher's own work before the launch (checking the command line)."""
    ctx = rank_context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


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


def stdio_for(ctx):
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


def write_whole_lines() -> None:
    """Ranks share the launcher's stdout and stderr: each line goes out in one write, which a pipe keeps whole
    (up to PIPE_BUF bytes), so another rank's text never lands between a print's text and its newline (it did,
    unbuffered or when a full block buffer split them)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(line_buffering=True, write_through=False)


def _skip_operator_deregistration() -> None:
    """torch.library's exit finalizers take every registered operator out of the dispatcher one by one (50 ms of
    each rank's exit here), for a process os._exit ends right after."""
    library = sys.modules.get("torch.library")
    deregister = getattr(library, "_del_library", None)
    if deregister is None:
        return
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        pending = finalizer.peek()
        if pending is not None and pending[1] is deregister:
            finalizer.atexit = False


def exit_skipping_teardown(code: int) -> None:
    """Exit a rank, or the program, with `code` once what it sent, started and buffered is out, skipping the
    interpreter's teardown.

    Teardown ends with a full garbage collection over torch's and megatron's objects (seconds after the work is
    done), and then extensions' leak checkers run: nanobind's (Triton's bindings) prints a hundred lines about
    objects a rank simply never freed. The OS reclaims the memory; os._exit skips both."""
    from multiprocessing import util

    util._exit_function()  # what multiprocessing does after the target: queue feeders flushed, children joined
    # what the interpreter does next: threading's exit callbacks (a ThreadPoolExecutor's tells its idle workers to
    # stop; joining them without it waits forever), then the join of every non-daemon thread
    threading._shutdown()
    _skip_operator_deregistration()
    atexit._run_exitfuncs()  # Python-level exit handlers, logging's flush among them
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# ---- a launcher's own question, answered where torch and megatron-core are imported already ----

class _ChildTraceback(Exception):
    """The child's traceback, as the cause of what it raised."""

    def __str__(self) -> str:
        return f"\n{self.args[0]}"


def call_in_rank_server(fn, *args):
    """fn(*args) in a child forked from the rank server, with this process's environment, folder and stdio:
    a launcher's check of its command line needs torch and megatron-core, whose imports (about 10 s of CPU) the
    server has done, and would otherwise repeat here. Returns what fn returns, or raises what it raised (its
    traceback as the cause). Where ranks are spawned there is no server: fn runs here."""
    ctx = rank_context()
    if ctx.get_start_method() != "forkserver":
        return fn(*args)
    receiving, sending = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_answer, name="command-line check", daemon=False,
                        args=(fn, args, sending, os.getpid(), dict(os.environ), os.getcwd(), stdio_for(ctx)))
    child.start()
    sending.close()
    try:
        kind, value, text = receiving.recv()
    except EOFError:
        child.join()
        raise RuntimeError(f"the command line's check in a forked process died (exit {child.exitcode})") from None
    except BaseException:  # interrupted meanwhile (a long data check): the child goes at once
        child.kill()
        raise
    finally:
        receiving.close()
    child.join(timeout=30)  # it exits right after its reply
    if child.exitcode is None:
        child.kill()
    if kind == "raised":
        raise value from _ChildTraceback(text)
    return value


def _answer(fn, args, sending, launcher_pid, environment, folder, stdio) -> None:
    import pickle
    import traceback

    die_with_launcher(launcher_pid)
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(folder)
    try:
        reply = ("returned", fn(*args), "")
    except BaseException as exc:  # noqa: BLE001 - the launcher raises it
        reply = ("raised", exc, traceback.format_exc())
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        sending.send(reply)
    except (pickle.PicklingError, TypeError, AttributeError):
        kind, value, text = reply
        sending.send(("raised", RuntimeError(f"{type(value).__name__}: {value}"), text))
    sending.close()
    exit_skipping_teardown(0)
