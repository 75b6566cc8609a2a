#!/usr/bin/env bash
# The test command: fast unit tests, then the multi-process training tests over gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && . .venv/bin/activate
python -m pytest -q "$@"
