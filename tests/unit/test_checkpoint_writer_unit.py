"""Megatron's checkpoint writer's results queue, started by fork (mm_adaptor.core.checkpoint_writer): its server is
a fork of this process (no fresh interpreter importing torch), it carries what the writers put on it, and it is
started once and stopped without a trace. A spawned one, as megatron-core starts it, must fail the first check."""

import multiprocessing as mp

import psutil
import pytest
import torch

from mm_adaptor.core import checkpoint_writer


@pytest.fixture
def writer():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    checkpoint_writer.stop_results_server()
    yield filesystem_async
    checkpoint_writer.stop_results_server()


def _server(writer) -> psutil.Process:
    return psutil.Process(writer._results_queue._manager._process.pid)


def _is_fork_of_this_process(server: psutil.Process) -> bool:
    return server.cmdline() == psutil.Process().cmdline() and "spawn_main" not in " ".join(server.cmdline())


def test_the_results_queue_is_served_by_a_fork_and_carries_torch_objects(writer):
    assert checkpoint_writer.fork_results_server() is True
    server = _server(writer)
    assert _is_fork_of_this_process(server), server.cmdline()
    writer._results_queue.put({"rank": 0, "sizes": [torch.Size([2, 3])]})
    assert writer._results_queue.get(timeout=30) == {"rank": 0, "sizes": [torch.Size([2, 3])]}
    assert checkpoint_writer.fork_results_server() is False  # started once
    assert _server(writer).pid == server.pid
    checkpoint_writer.stop_results_server()
    assert writer._results_queue is None
    assert server.wait(timeout=30) is not None or not server.is_running()


def test_a_spawned_server_is_told_apart(writer):
    """The broken variant: megatron-core's own way, a fresh interpreter."""
    writer._results_queue = mp.get_context("spawn").Manager().Queue()
    assert not _is_fork_of_this_process(_server(writer))
    assert checkpoint_writer.fork_results_server() is False  # one already there is kept
