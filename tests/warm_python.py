"""`python -c CODE` or `python -m MODULE ARGS` as subprocess.run runs them (output captured, text), forked from an
interpreter that imported torch and megatron-core once, as the trainer's ranks fork from a preloaded server: a fresh
interpreter spends 6-7 s of CPU on those imports. The child is a process of its own with the request's environment,
working directory, stdin (empty), stdout and stderr; its code runs at the interpreter's top level, so an uncaught
exception goes through sys.excepthook to exit status 1 and atexit runs, as in a fresh interpreter.

What it cannot show is the imports themselves (what importing torch or megatron-core does, the import order, the
garbage collector meanwhile): a test of those starts a fresh interpreter. A server serves one environment's PYTHON*
variables (read at start-up); a request with others gets a server of its own."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile

PRELOADED = ("torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
             "megatron.core.tensor_parallel", "megatron.core.transformer", "megatron.core.models.gpt",
             "megatron.core.optimizer")

_SERVER = r'''
import gc, importlib, json, os, sys, time

for name in PRELOADED:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
gc.freeze()  # the imports' objects: out of every collection (and the exit's) in the children, as in the rank server
replies = os.fdopen(os.dup(1), "w")


def finished(pid, timeout):
    end = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.01)


def serve():
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return request
        replies.write(json.dumps(finished(pid, request["timeout"])) + "\n")
        replies.flush()
    sys.exit(0)


request = serve()  # only a forked child returns
replies.close()
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                       (2, request["stderr"], os.O_WRONLY)):
    opened = os.open(path, mode)
    os.dup2(opened, fd)
    os.close(opened)
argv = request["argv"]
if argv[0] == "-m":
    import runpy

    sys.argv = argv[1:]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
else:
    import types

    sys.argv = ["-c", *argv[2:]]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    exec(compile(argv[1], "<string>", "exec"), main.__dict__)
'''

_SERVERS: dict[tuple, subprocess.Popen] = {}  # by the PYTHON* variables and the preloaded modules


def _server(env: dict, preload: tuple[str, ...]) -> subprocess.Popen:
    python = tuple(sorted((k, v) for k, v in env.items() if k.startswith("PYTHON")))
    server = _SERVERS.get((python, preload))
    if server is None or server.poll() is not None:
        code = f"PRELOADED = {preload!r}\n{_SERVER}"
        server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env={**os.environ, **dict(python)})
        _SERVERS[(python, preload)] = server
    return server


def server_pids() -> set[int]:
    """The running servers, which live as long as this process does (a check for processes left behind leaves them
    out, as it does multiprocessing's helpers)."""
    return {server.pid for server in _SERVERS.values() if server.poll() is None}


@atexit.register
def _stop_servers() -> None:
    for server in _SERVERS.values():
        if server.poll() is None:
            server.stdin.close()
            server.wait(30)


def run(argv: list[str], *, env: dict | None = None, cwd: str | None = None, timeout: float = 300,
        preload: tuple[str, ...] = PRELOADED) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    for argv = ["-c", code, ...] or ["-m", module, ...]; preload: the modules imported before the fork."""
    if argv[0] not in ("-c", "-m") or len(argv) < 2:
        raise ValueError(f"warm_python runs -c CODE or -m MODULE, not {argv[:2]}")
    env = dict(os.environ if env is None else env)
    server = _server(env, tuple(preload))
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        for path in (out, err):
            open(path, "w").close()
        request = dict(argv=list(argv), env=env, cwd=cwd or os.getcwd(), stdout=out, stderr=err, timeout=timeout)
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        reply = server.stdout.readline()
        if not reply:
            raise RuntimeError(f"the warm interpreter exited ({server.wait()}) before running {argv[:2]}")
        status = json.loads(reply)
        with open(out) as stdout, open(err) as stderr:
            output, errors = stdout.read(), stderr.read()
    command = [sys.executable, *argv]
    if status == "timeout":
        raise subprocess.TimeoutExpired(command, timeout, output, errors)
    return subprocess.CompletedProcess(command, status, output, errors)
