"""Runs `mm-adaptor check` (mm_adaptor.cli.main, in this process) once per argument list and prints one RESULT= JSON
line: each run's exit status, its output (captured at the file descriptors, which its ranks write to) and the
fake npu probe's rank files. One interpreter for every run: the ranks fork from one server with torch, megatron
and the fake torch_npu imported once. A script for a fresh interpreter (tests/npu/fake.py puts the FAKE torch_npu
on its path)."""

import json
import os
import sys
import tempfile


def one(argv: list[str]) -> dict:
    from mm_adaptor.cli import main

    probe = tempfile.mkdtemp(prefix="fake-npu-probe-")
    os.environ["MM_ADAPTOR_FAKE_NPU_PROBE"] = probe  # each rank gets the launcher's environment when it starts
    captured = [tempfile.TemporaryFile(mode="w+") for _ in range(2)]
    saved, streams = [os.dup(1), os.dup(2)], (sys.stdout, sys.stderr)
    try:
        for fd, file in zip((1, 2), captured):
            os.dup2(file.fileno(), fd)
        sys.stdout, sys.stderr = (open(fd, "w", closefd=False) for fd in (1, 2))
        try:
            status = main(["check", *argv])
        except SystemExit as exc:
            status = exc.code
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        sys.stdout, sys.stderr = streams
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
    out, err = [(file.seek(0), file.read())[1] for file in captured]
    probes = {}
    for name in sorted(os.listdir(probe)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(probe, name)) as f:
                probes[name] = json.load(f)
    return {"status": status, "stdout": out, "stderr": err, "probes": probes}


if __name__ == "__main__":
    runs = json.loads(sys.argv[1])
    print("RESULT=" + json.dumps([one(argv) for argv in runs]), flush=True)
