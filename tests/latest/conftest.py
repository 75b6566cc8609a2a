"""tests/latest runs only under megatron-core 0.17 or newer (scripts/test_latest_megatron.sh's own venv); the main
suite's 0.16 venv does not collect it."""

import importlib.metadata

from packaging.version import Version

if Version(importlib.metadata.version("megatron-core")) < Version("0.17"):
    collect_ignore_glob = ["test_*.py"]
