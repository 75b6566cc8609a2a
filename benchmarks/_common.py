"""Pieces the benchmark scripts share: timing, the device's copy bandwidth and the Markdown table they print."""

from __future__ import annotations

import platform
import statistics
import time
from importlib import metadata

import torch
from torch.utils import benchmark


def median_ms(fn, min_run_time: float) -> float:
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def cuda_median_ms(fn, min_run_time: float, block_ms: float = 20.0, min_blocks: int = 5) -> float:
    """Median per-call time from CUDA events: blocks of back-to-back calls (about block_ms each), each block
    timed on the GPU between two events and divided by its call count, until min_run_time seconds have passed."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    calls = max(1, int(block_ms / max(start.elapsed_time(end), 1e-3)))
    samples = []
    deadline = time.perf_counter() + min_run_time
    while len(samples) < min_blocks or time.perf_counter() < deadline:
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def device_median_ms(fn, min_run_time: float, device: str) -> float:
    """CUDA events on a CUDA device, torch.utils.benchmark elsewhere."""
    if torch.device(device).type == "cuda":
        return cuda_median_ms(fn, min_run_time)
    return median_ms(fn, min_run_time)


def copy_bandwidth_gbs(device: str, nbytes: int, min_run_time: float) -> float:
    """Device-to-device copy of an nbytes buffer: GB/s (1e9 bytes) = 2 x nbytes / time (a copy reads and writes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = device_median_ms(lambda: dst.copy_(src), min_run_time, device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def print_table_header(setup: str, columns: list[str]) -> None:
    """One line naming the machine and the setup, then a Markdown table header."""
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {setup}")
    print_columns(columns)


def print_columns(columns: list[str]) -> None:
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns), flush=True)


def llama_like_driver_options(args, *extra: str):
    """The training driver's options, on one rank, for a Llama-like model shaped by args (layers, hidden, ffn,
    heads, seq, micro_batch): SwiGLU, RMSNorm, RoPE, no bias; `extra` flags after them."""
    from mm_adaptor.harness.runner.arguments import build_parser, finalize_args

    argv = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--ffn-hidden-size", str(args.ffn),
            "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq), "--micro-batch-size",
            str(args.micro_batch), "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--disable-bias-linear", "--nproc-per-node", "1", *extra]
    parsed = build_parser().parse_args(argv)
    finalize_args(parsed, 1)
    return parsed


def init_single_rank(dist_backend: str = "gloo") -> None:
    """A one-rank process group and megatron's model-parallel state (all sizes 1), both torn down at exit: a gloo
    group left to the interpreter's shutdown can abort the process (exit -6) after its results were printed."""
    import atexit
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    from mm_adaptor.ranks.launcher import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(dist_backend, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    atexit.register(_destroy_single_rank)


def _destroy_single_rank() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


ITERATION_FIELD = r"\| {}(?: \([^)]*\))?: ([^|]+?) \|"  # "tokens per second (padded)" too


def forked(fn, timeout: float | None = None) -> tuple[int, str, str]:
    """fn() in a child forked from this process, which starts with its imports (a fresh interpreter spends seconds
    of CPU importing torch and megatron): (exit status, stdout, stderr). The status is fn's int result (0 for
    None), 1 when it raised (traceback on stderr), -9 past `timeout`. For the CPU: a child forked after this
    process initialised CUDA cannot use it."""
    import os
    import signal
    import sys
    import tempfile
    import traceback

    from mm_adaptor.ranks.process import exit_skipping_teardown

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                _own_exit()
                result = fn()
                code = result if isinstance(result, int) else 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
                if code and not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            finally:
                exit_skipping_teardown(code)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            if deadline is not None and time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(done[1]), out.read(), err.read()


def _own_exit() -> None:
    """In a forked child: at its exit only what it registers runs (not its parent's exit handlers, which e.g.
    remove the parent's temporary folders), as in a fresh process; multiprocessing's state reset as for its own
    forked children."""
    import atexit
    import weakref
    from multiprocessing import process, util

    atexit._clear()
    for finalizer in list(weakref.finalize._registry):
        finalizer.atexit = False
    atexit.register(weakref.finalize._exitfunc)
    process._children.clear()
    util._finalizer_registry.clear()
    util._run_after_forkers()


def run_cli(argv: list[str], timeout: float = 3600, fork: bool = False) -> tuple[int, str, str]:
    """`python -m mm_adaptor.cli argv`: (exit status, stdout, stderr); with fork, its main() in a forked child
    (forked), as the program runs it."""
    import subprocess
    import sys

    if not fork:
        done = subprocess.run([sys.executable, "-m", "mm_adaptor.cli", *argv], capture_output=True, text=True,
                              timeout=timeout)
        return done.returncode, done.stdout, done.stderr
    import mm_adaptor.cli
    import mm_adaptor.ranks.preload  # noqa: F401  (torch, megatron.training: imported once, before the forks)

    def program():
        sys.argv = [mm_adaptor.cli.__file__.replace("__init__", "__main__"), *argv]
        return mm_adaptor.cli.main(argv)

    return forked(program, timeout)


def train_as_a_user(argv: list[str], timeout: float = 3600, fork: bool = False) -> dict:
    """`mm-adaptor train argv`, the trainer on Megatron-LM's loop, as a user runs it, one iteration line per step:
    the mean iteration ms and non-padding tokens/s of every step but the first (its compilation and warm-up), the
    last line's peak memory (most loaded rank) and the last step's loss. fork: see run_cli."""
    import re

    returncode, stdout, stderr = run_cli(["train", *argv, "--log-interval", "1", "--log-tps"], timeout, fork)
    lines = [line for line in stdout.splitlines() if re.search(r" iteration +\d+/ *\d+ \|", line)]
    if returncode != 0 or len(lines) < 2:
        raise SystemExit(f"mm-adaptor train {' '.join(argv)} failed or logged under 2 iterations:\n"
                         f"{stdout[-2000:]}\n{stderr[-3000:]}")

    def values(name: str) -> list[float]:
        return [float(re.search(ITERATION_FIELD.format(re.escape(name)), line).group(1)) for line in lines]

    later = slice(1, None)
    return {"iteration_ms": statistics.mean(values("elapsed time per iteration (ms)")[later]),
            "tokens_per_second": statistics.mean(values("tokens per second")[later]),
            "peak_bytes": values("peak memory (GiB, most loaded rank)")[-1] * 2**30,
            "loss": values("lm loss")[-1]}
