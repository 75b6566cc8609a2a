"""Runs code in a fresh interpreter with the FAKE torch_npu (tests/fake_npu) importable: importing it changes torch
for the whole process, so it never enters the test session's own interpreter."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import warm_python

FAKE_NPU_PATH = Path(__file__).resolve().parent.parent / "fake_npu"


def env(devices: int = 2, **extra) -> dict:
    merged = dict(os.environ)
    merged["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKE_NPU_PATH), merged.get("PYTHONPATH")]))
    merged["MM_ADAPTOR_FAKE_NPU_DEVICES"] = str(devices)
    merged.update({k: str(v) for k, v in extra.items()})
    return merged


def run_python(source: str, *, devices: int = 2, timeout: int = 600, **extra) -> dict:
    """Run `source` (it must print one JSON line prefixed RESULT=) and return that JSON. The interpreter has
    imported torch alone (warm_python): the script imports torch_npu before megatron-core, as a user's does."""
    done = warm_python.run(["-c", textwrap.dedent(source)], env=env(devices, **extra), timeout=timeout,
                           preload=("torch",))
    for line in done.stdout.splitlines():
        if line.startswith("RESULT="):
            return json.loads(line[len("RESULT="):])
    raise AssertionError(f"no result (rc {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


# Script source: `out` gets, for each entry of the script's `calls` dict, "accepted" or the text of its refusal.
TRY_EACH_CALL = """
out = {}
for name, call in calls.items():
    try:
        call()
        out[name] = "accepted"
    except Exception as exc:
        out[name] = str(exc)
"""


def assert_refusals(result: dict, refused: dict, accepted) -> None:
    """Each call in `refused` was refused with its words; each in `accepted` went through."""
    for name, words in refused.items():
        assert words in result[name], (name, result[name])
    for name in accepted:
        assert result[name] == "accepted", (name, result[name])
