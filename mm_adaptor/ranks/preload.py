"""What the server that ranks fork from imports once (launcher.py): torch and megatron-core, most of a rank's start.

The warnings and log records these imports raise are kept, and each rank reports them as its own (`replay`), so a
forked rank prints what a spawned one did. Nothing here depends on the rank: options, patches and the device backend
are applied in the rank, after the fork."""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import sys

from mm_adaptor.core.imports import without_gc
from mm_adaptor.ranks.warning_digest import forwarding

MODULES = (
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.models.mimo.model.base",  # get_megatron_optimizer's first line imports it (0.19)
    "megatron.core.distributed",
    "megatron.core.pipeline_parallel",
    "megatron.training.training",  # the trainer's engine (absent from megatron-core 0.16's wheel)
    "megatron.training.checkpointing",
    "megatron.core.tokenizers.text",  # Megatron's tokenizers (transformers: seconds), built in every trainer rank
    "mm_adaptor.ops",  # our ops' schemas with torch.library (0.2 s: torch reads each fake's source); kernels load later
)
# What the server runs once its imports are done, named as MODULES are (module:function)
WARM_UPS = (
    "mm_adaptor.train.argument_docs:warm",  # Megatron's parser reads these docstrings in every trainer rank otherwise
)
NOTICES: list[str] = []  # what importing MODULES said, as a rank's warning forwarder words it


def _preload() -> None:
    undo = forwarding(NOTICES.append)
    try:
        for module in MODULES:
            try:
                __import__(module)
            except ImportError:
                pass
        for warm_up in WARM_UPS:
            module, function = warm_up.split(":")
            try:
                run = getattr(importlib.import_module(module), function)
            except ImportError:
                continue
            run()
    finally:
        undo()


def replay(send) -> None:
    """In a forked rank: the import-time notices go to the rank's own forwarder, as if raised there."""
    for notice in NOTICES:
        send(notice)


def _server_exits_without_teardown(server_pid: int = os.getpid()) -> None:
    """The server ends when its launcher does; the interpreter's teardown over torch and megatron would take
    another 2 s, while it still holds the launcher's stdout (a caller reading it to the end waits). A rank forked
    from it inherits this handler, and is not the server."""
    if os.getpid() == server_pid:
        os._exit(0)


def _imported_by_the_server() -> bool:
    """multiprocessing's forkserver imports this module from its main(); any other importer (a test, a tool) must
    keep its own exit status."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_code.co_filename.endswith(os.path.join("multiprocessing",
                                                                                               "forkserver.py")):
            return True
        frame = frame.f_back
    return False


with without_gc():
    _preload()
EXITS_WITHOUT_TEARDOWN = _imported_by_the_server()
if EXITS_WITHOUT_TEARDOWN:
    atexit.register(_server_exits_without_teardown)
    # What the server imported lives as long as each rank: the ranks' collections leave it alone (no pass over a
    # million objects, no copy of their pages into the rank)
    gc.freeze()
