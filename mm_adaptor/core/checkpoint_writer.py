"""Megatron's torch_dist checkpoint writer reports its write results through a multiprocessing Manager's queue,
which megatron-core starts by spawn on a process's first save and keeps for the process's life. The results it
unpickles make that fresh interpreter import torch: 4 to 6 s of CPU per saving process. Started by fork, from a
process that has torch, it is up at once; it only serves the queue (Megatron-LM forks its persistent asynchronous
checkpoint writer so too)."""

from __future__ import annotations

import inspect
import multiprocessing as mp
import warnings


def fork_results_server() -> bool:
    """Start the writer's results queue by fork unless it is started already. True when this call started it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as writer

    if getattr(writer, "_results_queue", True) is not None or "fork" not in mp.get_all_start_methods():
        return False
    with warnings.catch_warnings():  # Python 3.12's note on forking a process with threads: the child runs none
        warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
        make = getattr(writer, "get_write_results_queue", None)  # megatron-core 0.17+: the context is a parameter
        if make is not None and "mp_mode" in inspect.signature(make).parameters:
            make(mp_mode="fork")
        else:  # 0.16's _get_write_results_queue() has none: what it does, in the fork context
            writer._results_queue = mp.get_context("fork").Manager().Queue()
    return True


def stop_results_server() -> None:
    """Shut the results queue's server down: a converter called as a library must not leave that process behind."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as writer

    queue = getattr(writer, "_results_queue", None)
    if queue is not None:
        queue._manager.shutdown()
        writer._results_queue = None
