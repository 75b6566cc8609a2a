import fcntl
import gc
import json
import os
import shutil
import tempfile
from collections import defaultdict

import pytest

from gloo_rank import one_gloo_rank

os.environ.setdefault("PYTHONWARNINGS", "ignore")
gc.disable()  # until the test modules are imported (pytest_collection_finish)
# One unpatched baseline per configuration for the whole session (the harness caches it by arguments).
_own_baseline_cache = "MM_ADAPTOR_BASELINE_CACHE" not in os.environ
if _own_baseline_cache:
    os.environ["MM_ADAPTOR_BASELINE_CACHE"] = tempfile.mkdtemp(prefix="mm-adaptor-baselines-")
# The data indexes the tests build (each of a temporary data set) stay out of the user's cache.
_own_data_cache = "MM_ADAPTOR_DATA_CACHE" not in os.environ
if _own_data_cache:
    os.environ["MM_ADAPTOR_DATA_CACHE"] = tempfile.mkdtemp(prefix="mm-adaptor-data-index-")


# The test command's time guard (scripts/time_budget.py) reads each leg's seconds per test file from here.
# Taken out of the environment, so that a pytest a test starts records nothing over this session's record.
_times_path = os.environ.pop("MM_ADAPTOR_TEST_TIMES", None)
_seconds_per_file: dict[str, float] = defaultdict(float)


def pytest_collection_modifyitems(config, items):
    """The builder's concurrency test first: on an empty cache its one build is the one every later test loads."""
    first = [item for item in items if item.name == "test_concurrent_processes_build_once_and_all_load"]
    items[:] = first + [item for item in items if item not in first]


def pytest_collection_finish(session):
    """What the test modules imported (torch, megatron-core, transformers) lives as long as the session: out of the
    collector's passes, which ran over it again and again (mm_adaptor.core.imports)."""
    gc.freeze()
    gc.enable()


def pytest_runtest_logreport(report):
    _seconds_per_file[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_sessionfinish(session, exitstatus):
    if _own_baseline_cache:
        shutil.rmtree(os.environ["MM_ADAPTOR_BASELINE_CACHE"], ignore_errors=True)
    if _own_data_cache:
        shutil.rmtree(os.environ["MM_ADAPTOR_DATA_CACHE"], ignore_errors=True)
    path = _times_path
    if path and _seconds_per_file:
        with open(f"{path}.lock", "w") as lock:  # legs that run side by side finish into the same file
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with open(path) as f:
                    recorded = json.load(f)
            except (OSError, ValueError):
                recorded = {}
            leg = os.environ.get("MM_ADAPTOR_TEST_LEG", "suite")
            legs = recorded.setdefault("legs", {})
            # a leg may run as several sessions (the newest leg's unit tests run beside the older legs)
            files = {**legs.get(leg, {}), **{name: round(seconds, 1) for name, seconds in _seconds_per_file.items()}}
            legs[leg] = dict(sorted(files.items()))
            with open(path, "w") as f:
                json.dump(recorded, f, indent=1, sort_keys=True)


@pytest.fixture(autouse=True)
def warnings_routed_as_before():
    """A command run in the test's own process may act as a rank (RANK and WORLD_SIZE set: torchrun's) and route
    warnings to its launcher for good, as a rank process does; the next test gets the routing it had."""
    import logging
    import warnings

    from mm_adaptor.ranks import warning_digest

    root, torch_notes = logging.getLogger(), logging.getLogger(warning_digest.TORCH_CPP_EXTENSION_LOGGER)
    handlers, filters, show = list(root.handlers), list(torch_notes.filters), warnings.showwarning
    yield
    root.handlers[:] = handlers
    torch_notes.filters[:] = filters
    warnings.showwarning = show
    warning_digest._undo_command_forwarding = None


@pytest.fixture
def single_rank_megatron():
    with one_gloo_rank():
        yield


@pytest.fixture(scope="session")
def native_ops_built():
    """For tests that judge what a command prints: the native ops' first use builds them and says so, line by line
    (minutes from empty caches, as on a fresh CI machine); the command's own printout comes after that."""
    from mm_adaptor.ops import builder

    builder.build("cpu")


@pytest.fixture(scope="module")
def megatron_fusions_eager():
    """Megatron's torch.compile'd fusions (jit_fuser) run their operations eagerly: a unit test compares their
    arithmetic, and compiling them cost 10-19 s of a core each on the CPU (bias_swiglu, GroupedMLP's activation)."""
    import torch

    with torch.compiler.set_stance("force_eager"):
        yield
