#!/usr/bin/env bash
# The test command: sets up .venv if needed (idempotent), then runs the whole suite.
# Pass pytest arguments through, e.g. `bash scripts/test.sh -m "not distributed"` for the fast unit tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
. .venv/bin/activate
python -m pytest -q "$@"
