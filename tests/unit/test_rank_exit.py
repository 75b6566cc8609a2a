"""A rank ends without interpreter teardown: no final collection and no leak report from nanobind extensions
(Triton's bindings in every CUDA build of torch), while its exit status, traceback and last warnings still arrive."""

import os
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import pytest

from mm_adaptor.ranks.launcher import LaunchError, launch

nanobind = pytest.importorskip("nanobind")

MODULE = "mm_adaptor_test_leaky_nb"
SOURCE = f"""
#include <nanobind/nanobind.h>
struct Handle {{ int value = 0; }};
NB_MODULE({MODULE}, m) {{ nanobind::class_<Handle>(m, "Handle").def(nanobind::init<>()); }}
"""


@pytest.fixture(scope="module")
def nanobind_extension() -> Path:
    """A one-class nanobind extension, built once per nanobind and Python version (about 30 s) and cached."""
    tag = f"nanobind-{nanobind.__version__}-{sysconfig.get_config_var('SOABI')}"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mm_adaptor-tests" / tag
    library = cache / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if library.exists():
        return cache
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "module.cpp").write_text(SOURCE)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    root = Path(nanobind.source_dir()).parent
    subprocess.run(["c++", "-std=c++17", "-O0", "-shared", "-fPIC", "-fvisibility=hidden",
                    f"-I{nanobind.include_dir()}", f"-I{root / 'ext' / 'robin_map' / 'include'}",
                    f"-I{sysconfig.get_paths()['include']}", str(cache / "module.cpp"),
                    str(root / "src" / "nb_combined.cpp"), "-o", str(partial)],
                   check=True, capture_output=True, timeout=600)
    partial.rename(library)
    return cache


def _hold_an_instance_in_a_cycle(path):
    """What Triton leaves behind: extension objects that only a garbage collection frees."""
    sys.path.insert(0, path)
    module = __import__(MODULE)
    cycle = [module.Handle()]
    cycle.append(cycle)


def _fail_after_holding(path):
    _hold_an_instance_in_a_cycle(path)
    raise ValueError("boom after the extension was used")


def test_a_rank_exits_without_a_nanobind_leak_report(nanobind_extension, capfd):
    launch(_hold_an_instance_in_a_cycle, (str(nanobind_extension),), nproc=2, timeout=120)
    assert "nanobind: leaked" not in capfd.readouterr().err


def test_a_failing_rank_still_reports_its_traceback_without_a_leak_report(nanobind_extension, capfd):
    with pytest.raises(LaunchError, match="rank 0 failed: ValueError: boom after the extension was used"):
        launch(_fail_after_holding, (str(nanobind_extension),), nproc=1, timeout=120)
    assert "nanobind: leaked" not in capfd.readouterr().err


def test_the_extension_leaks_under_ordinary_teardown(nanobind_extension):
    """The check above can fail: the same rank body in a process that exits the ordinary way is reported."""
    script = (f"import gc, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
              f"from test_rank_exit import _hold_an_instance_in_a_cycle as hold; "
              f"hold({str(nanobind_extension)!r}); gc.freeze()")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "nanobind: leaked 1 instances!" in done.stderr


def _warn_last():
    warnings.simplefilter("always")  # the test session's ranks ignore warnings (PYTHONWARNINGS)
    warnings.warn("said just before the rank exits", stacklevel=1)


def test_a_warning_given_just_before_exit_arrives(capfd):
    launch(_warn_last, nproc=1, timeout=120)
    assert "warning: UserWarning: said just before the rank exits" in capfd.readouterr().err


def _exit_with(code):
    raise SystemExit(code)


def test_a_rank_raising_system_exit_is_reported_failed():
    with pytest.raises(LaunchError, match="rank 0 failed: SystemExit: 3"):
        launch(_exit_with, (3,), nproc=1, timeout=120)


def _leave_an_idle_thread_pool():
    """Megatron's checkpointing (and torch's) start executors whose idle workers are non-daemon threads."""
    from concurrent.futures import ThreadPoolExecutor

    global _POOL  # held, as a library holds its executor, so no garbage collection wakes its workers
    _POOL = ThreadPoolExecutor(max_workers=1)
    _POOL.submit(int).result()


def test_a_rank_with_an_idle_thread_pool_still_exits():
    """Joining the workers without threading's exit callbacks (which tell them to stop) waited forever."""
    launch(_leave_an_idle_thread_pool, (), nproc=1, timeout=60)
