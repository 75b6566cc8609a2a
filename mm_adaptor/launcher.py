"""Start N local ranks on a free port, with a timeout; surface a failing rank's traceback."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
import warnings
from queue import Empty
from typing import Any, Callable

RANK_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(RuntimeError):
    """A rank died, raised, or hung; the message carries its traceback or names the hung ranks."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def under_launcher() -> bool:
    """True when torchrun (or another launcher) already set the rank environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _forward_warnings_to(queue) -> None:
    """A rank's warnings go to the launcher, which prints each distinct one once for all ranks."""

    def show(message, category, filename, lineno, file=None, line=None):
        queue.put(f"{category.__name__}: {message}")

    warnings.showwarning = show


_shown_warnings: set[str] = set()


def _print_new_warnings(queue) -> None:
    while True:
        try:
            text = queue.get_nowait()
        except Empty:
            return
        if text not in _shown_warnings:
            _shown_warnings.add(text)
            print(f"warning: {text}", file=sys.stderr, flush=True)


def _rank_entry(fn, args, rank, world_size, port, threads, errors, rank_warnings):
    _forward_warnings_to(rank_warnings)
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
        raise SystemExit(1)


# The free port is found by binding and releasing it, so another process can take it before rank 0 listens; the
# ranks then fail while rendezvousing, before any work, and start again on a new port.
PORT_ATTEMPTS = 3
_PORT_TAKEN = ("EADDRINUSE", "address already in use")


def launch(fn: Callable[..., Any], args: tuple = (), *, nproc: int, timeout: float | None = None,
           threads_per_rank: int | None = None) -> None:
    """Run fn(*args) in `nproc` spawned ranks; raise LaunchError if any fails or time runs out."""
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {nproc}")
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // nproc)
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _launch_once(fn, args, nproc, timeout, threads_per_rank, free_port())
        except LaunchError as exc:
            if attempt == PORT_ATTEMPTS or not any(text in str(exc) for text in _PORT_TAKEN):
                raise


def _launch_once(fn, args, nproc, timeout, threads_per_rank, port) -> None:
    ctx = mp.get_context("spawn")
    errors, rank_warnings = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_rank_entry, args=(fn, args, rank, nproc, port, threads_per_rank, errors, rank_warnings),
                    name=f"rank{rank}", daemon=False)
        for rank in range(nproc)
    ]
    for proc in procs:
        proc.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    failed: tuple[int, str, str] | None = None
    try:
        while any(p.is_alive() for p in procs):
            _print_new_warnings(rank_warnings)
            if failed is None:
                failed = _first_failure(procs, errors)
                if failed is not None:
                    _stop(procs, grace=5.0)
                    break
            if deadline is not None and time.monotonic() > deadline:
                hung = [i for i, p in enumerate(procs) if p.is_alive()]
                _stop(procs, grace=0.0)
                raise LaunchError(
                    f"timed out after {timeout:.0f}s: rank(s) {', '.join(map(str, hung))} still running "
                    "(a hang in a collective usually means the ranks disagree on the layout or one rank "
                    "skipped a communication)"
                )
            time.sleep(0.05)
        if failed is None:
            failed = _first_failure(procs, errors)
    except KeyboardInterrupt:
        _stop(procs, grace=0.0)
        raise
    finally:
        for proc in procs:
            proc.join(timeout=1.0)
        _print_new_warnings(rank_warnings)
    if failed is not None:
        rank, summary, tb = failed
        raise LaunchError(f"rank {rank} failed: {summary}\n--- traceback of rank {rank} ---\n{tb}")


def _first_failure(procs, errors):
    if not errors.empty():
        return errors.get()
    for rank, proc in enumerate(procs):
        if proc.exitcode not in (None, 0):
            time.sleep(0.2)  # give its traceback a moment to arrive
            if not errors.empty():
                return errors.get()
            return rank, f"exited with code {proc.exitcode} without a Python traceback (killed or crashed)", ""
    return None


def _stop(procs, grace: float) -> None:
    end = time.monotonic() + grace
    for proc in procs:
        while proc.is_alive() and time.monotonic() < end:
            time.sleep(0.05)
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=5.0)
        if proc.is_alive():
            proc.kill()
