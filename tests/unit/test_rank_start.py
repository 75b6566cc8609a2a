"""Ranks fork from a server that imported torch and megatron-core once (launcher.rank_context): each rank is still
a fresh process, so nothing one run patches reaches the next; a launcher whose environment changed spawns instead;
a forked rank writes to the launcher's stdout as it is now and reports the import-time warnings as its own."""

import io
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from mm_adaptor.ranks import launcher

from mm_adaptor.ranks import process
from mm_adaptor.ranks.launcher import launch

# more objects frozen than this: the rank server's imports (core.imports); a plain process has a few hundred frozen
SERVER_IMPORTS_FROZEN = 100_000


def _record(path):
    state = {
        "preloaded": "mm_adaptor.ranks.preload" in sys.modules and "megatron.core" in sys.modules,
        "server_exits_without_teardown": getattr(sys.modules.get("mm_adaptor.ranks.preload"),
                                                 "EXITS_WITHOUT_TEARDOWN", None),
        "parent": os.getppid(),
        "marker": os.environ.get("MM_ADAPTOR_TEST_MARKER"),
        "torch_marker": os.environ.get("TORCH_TEST_MARKER"),
        "whole_lines": sys.stdout.line_buffering and not sys.stdout.write_through,
        "frozen": __import__("gc").get_freeze_count(), "collects": __import__("gc").isenabled(),
    }
    if os.environ["RANK"] == "0":
        with open(path, "w") as f:
            json.dump(state, f)


def _patch_megatron_and_report(path):
    """Run 1 rebinds a megatron function, as a feature's patch does, and never reverts it."""
    from megatron.core import parallel_state

    seen = getattr(parallel_state.get_tensor_model_parallel_rank, "_leaked_from_an_earlier_run", False)
    replacement = lambda: 0  # noqa: E731
    replacement._leaked_from_an_earlier_run = True
    parallel_state.get_tensor_model_parallel_rank = replacement
    if os.environ["RANK"] == "0":
        with open(path, "a") as f:
            f.write(f"{seen}\n")


@pytest.fixture
def fork_server(monkeypatch):
    if "forkserver" not in __import__("multiprocessing").get_all_start_methods():
        pytest.skip("this OS cannot fork")
    monkeypatch.delenv(process.RANK_START_ENV, raising=False)


def test_ranks_fork_from_the_preloaded_server_and_nothing_leaks_between_runs(tmp_path, fork_server):
    path = tmp_path / "state.json"
    launch(_record, (str(path),), nproc=2, timeout=120)
    state = json.loads(path.read_text())
    assert state["preloaded"], "the rank did not start from the server's imports"
    assert state["parent"] != os.getpid(), "a forked rank is the server's child, not the launcher's"
    assert state["whole_lines"], "the rank's stdout may split a line between writes"
    assert state["server_exits_without_teardown"] is True
    # the server's imports are frozen out of the rank's collections (core.imports), and the rank collects
    assert state["frozen"] > SERVER_IMPORTS_FROZEN and state["collects"], state

    seen = tmp_path / "seen"
    for _ in range(2):
        launch(_patch_megatron_and_report, (str(seen),), nproc=2, timeout=120)
    assert seen.read_text().split() == ["False", "False"], "run 2 saw run 1's patch"


def test_another_process_importing_the_server_s_preload_keeps_its_exit_status():
    """The server's exit skips teardown with status 0; a process that merely imports the module (a test, a tool)
    must not exit 0 whatever happened."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", "import gc, mm_adaptor.ranks.preload as p; assert not "
                           "p.EXITS_WITHOUT_TEARDOWN and gc.isenabled() and "
                           f"gc.get_freeze_count() < {SERVER_IMPORTS_FROZEN}; raise SystemExit(3)"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr[-2000:]


def test_a_changed_environment_gets_a_new_server(tmp_path, fork_server, monkeypatch):
    path = tmp_path / "state.json"
    launch(_record, (str(path),), nproc=2, timeout=120)  # the server exists with this environment
    first_server = json.loads(path.read_text())["parent"]
    monkeypatch.setenv("MM_ADAPTOR_TEST_MARKER", "changed")  # read by mm_adaptor in the rank, not at import
    launch(_record, (str(path),), nproc=2, timeout=120)
    state = json.loads(path.read_text())
    assert state["marker"] == "changed" and state["parent"] == first_server, "an mm_adaptor setting needs no server"
    monkeypatch.setenv("TORCH_TEST_MARKER", "changed")  # torch and megatron could read this one at import
    launch(_record, (str(path),), nproc=2, timeout=120)
    state = json.loads(path.read_text())
    assert state["preloaded"] and state["torch_marker"] == "changed"
    assert state["parent"] != first_server, "the server that started with the old environment forked the rank"
    assert not __import__("psutil").pid_exists(first_server), "the old server is still running"


def _linger():
    time.sleep(600)


def test_a_rank_left_running_is_not_taken_for_the_server(fork_server):
    """The leftover-process checks skip the server ranks fork from; a rank forked from it shows the same command
    line, and must still count as left behind."""
    import psutil

    launch(_record_nothing, nproc=1, timeout=120)  # the server is up
    server = next(p for p in psutil.Process().children() if launcher.is_process_helper(p)
                  and "forkserver" in " ".join(p.cmdline()))
    ctx = launcher.rank_context()
    rank = ctx.Process(target=_linger)
    rank.start()
    try:
        forked = psutil.Process(rank.pid)
        assert forked.parent().pid == server.pid and "forkserver" in " ".join(forked.cmdline())
        assert not launcher.is_process_helper(forked)
    finally:
        rank.kill()
        rank.join()


def _record_nothing():
    pass


def test_spawn_on_request(monkeypatch):
    monkeypatch.setenv(process.RANK_START_ENV, "spawn")
    assert launcher.rank_context().get_start_method() == "spawn"


@pytest.mark.parametrize("device,method", [("cuda", "spawn"), ("cpu", "forkserver")])
def test_cuda_ranks_are_spawned(monkeypatch, device, method):
    """A rank forked from the server could not initialise CUDA (megatron's imports poison forks there, below)."""
    monkeypatch.delenv(process.RANK_START_ENV, raising=False)
    monkeypatch.setenv("MM_ADAPTOR_DEVICE", device)
    assert launcher.rank_context().get_start_method() == method


def test_without_gpu_device_nodes_a_launcher_decides_without_importing_torch(monkeypatch, tmp_path):
    """`mm-adaptor train`'s launcher asks whether ranks run on CUDA before anything else imports torch (3 s of CPU):
    with no GPU driver's device node it answers no as torch would; the nodes it finds are the ones torch is asked on."""
    env = {key: value for key, value in os.environ.items() if key != "MM_ADAPTOR_DEVICE"}
    probe = ("import sys; from mm_adaptor.ranks import process; process.DEVICE_NODES = sys.argv[1]; "
             "print(process._ranks_run_on_cuda(), 'torch' in sys.modules)")
    (tmp_path / "null").touch()
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.stdout.split() == ["False", "False"], done.stdout + done.stderr

    monkeypatch.setattr(process, "DEVICE_NODES", str(tmp_path))
    for node in ("nvidia0", "kfd", "dxg"):  # NVIDIA's driver, ROCm's, WSL's: then torch is asked
        (tmp_path / node).touch()
        assert process._gpu_device_nodes() == [node]
        (tmp_path / node).unlink()


def _bad_fork(queue):
    import torch

    queue.put(torch.cuda._is_in_bad_fork())


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="torch.cuda is a stub in a CPU-only build of torch")
def test_a_rank_forked_from_the_server_cannot_use_cuda(monkeypatch):
    """Why: on a CUDA build of torch the server's megatron imports register torch's fork guard, GPU or not."""
    monkeypatch.delenv(process.RANK_START_ENV, raising=False)
    monkeypatch.setenv("MM_ADAPTOR_DEVICE", "cpu")
    context = launcher.rank_context()
    queue = context.Queue()
    rank = context.Process(target=_bad_fork, args=(queue,))
    rank.start()
    rank.join(60)
    assert queue.get(timeout=5) is True


_CALLER = textwrap.dedent('''
    import sys, warnings
    from mm_adaptor.ranks.launcher import launch

    def hello():
        import os
        print(f"hello from rank {os.environ['RANK']}", flush=True)

    if __name__ == "__main__":
        launch(hello, nproc=1, timeout=120)          # starts the server: its stdout is this process's now
        sys.stdout.flush()
        with open(sys.argv[1], "w") as out:
            import os
            os.dup2(out.fileno(), 1)                 # stdout moves, as a test's capture or a redirect does
            launch(hello, nproc=1, timeout=120)
''')


def test_a_forked_rank_writes_to_the_launcher_s_stdout_as_it_is_now(tmp_path, fork_server):
    script = tmp_path / "caller.py"
    script.write_text(_CALLER)
    moved = tmp_path / "moved.txt"
    first = subprocess.run([sys.executable, str(script), str(moved)], capture_output=True, text=True, timeout=300,
                           env={k: v for k, v in os.environ.items() if k != process.RANK_START_ENV})
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("hello from rank 0") == 1, first.stdout
    assert moved.read_text().count("hello from rank 0") == 1, "the second rank wrote to the server's stdout"


class _Writes(io.RawIOBase):
    def __init__(self):
        self.calls = []

    def writable(self):
        return True

    def write(self, data):
        self.calls.append(bytes(data))
        return len(data)


@pytest.mark.parametrize("whole", [True, False])
def test_a_printed_line_is_one_write_even_unbuffered(monkeypatch, whole):
    raw = _Writes()
    unbuffered = io.TextIOWrapper(raw, write_through=True)  # stdout as PYTHONUNBUFFERED makes it
    monkeypatch.setattr(sys, "stdout", unbuffered)
    if whole:
        process.write_whole_lines()
    print("iteration 1 |", flush=True)
    if whole:
        assert raw.calls == [b"iteration 1 |\n"]
    else:  # the broken variant: another rank's text can land between these two
        assert raw.calls == [b"iteration 1 |", b"\n"]


def _where():
    return {"pid": os.getpid(), "parent": os.getppid(), "folder": os.getcwd(),
            "marker": os.environ.get("MM_ADAPTOR_TEST_MARKER"), "preloaded": "megatron.core" in sys.modules}


def _refuse():
    from mm_adaptor.train.arguments import UsageError

    raise UsageError("first problem", "second problem")


def test_a_launchers_question_is_answered_by_a_fork_of_the_rank_server(monkeypatch, tmp_path):
    """mm-adaptor train checks its command line there (call_in_rank_server), not in the launcher: the answer comes
    from another process, the server's child, with the launcher's environment and folder; what it raises is raised
    here. (Run in this process, the first assertion fails.)"""
    from mm_adaptor.train.arguments import UsageError

    monkeypatch.setenv("MM_ADAPTOR_TEST_MARKER", "asked")
    monkeypatch.chdir(tmp_path)
    where = process.call_in_rank_server(_where)
    assert where["pid"] != os.getpid() and where["parent"] != os.getpid(), where
    assert "forkserver" in " ".join(psutil_cmdline(where["parent"]))
    assert where["folder"] == str(tmp_path) and where["marker"] == "asked" and where["preloaded"], where
    with pytest.raises(UsageError) as refused:
        process.call_in_rank_server(_refuse)
    assert refused.value.problems == ["first problem", "second problem"]


def psutil_cmdline(pid: int) -> list[str]:
    import psutil

    return psutil.Process(pid).cmdline()
