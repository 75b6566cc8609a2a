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
    from tests.trainer_runs import captured_output

    probe = tempfile.mkdtemp(prefix="fake-npu-probe-")
    os.environ["MM_ADAPTOR_FAKE_NPU_PROBE"] = probe  # each rank gets the launcher's environment when it starts
    with captured_output() as texts:
        try:
            status = main(["check", *argv])
        except SystemExit as exc:
            status = exc.code
    out, err = texts
    probes = {}
    for name in sorted(os.listdir(probe)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(probe, name)) as f:
                probes[name] = json.load(f)
    return {"status": status, "stdout": out, "stderr": err, "probes": probes}


if __name__ == "__main__":
    runs = json.loads(sys.argv[1])
    print("RESULT=" + json.dumps([one(argv) for argv in runs]), flush=True)
