#!/usr/bin/env bash
# The test command: sets up .venv if needed (idempotent), then runs the whole suite on megatron-core 0.16.1 (Python 3.11)
# and then on the newest supported release in its own Python 3.12 venv (scripts/test_latest_megatron.sh).
# Pass pytest arguments through, e.g. `bash scripts/test.sh -m "not distributed"` for the fast unit tests; a selection
# (-m, -k or a path) runs on 0.16.1 only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
. .venv/bin/activate
selected=no
for arg in "$@"; do
  case "$arg" in -m|-k|-m*|-k*) selected=yes ;; *) [ -e "${arg%%::*}" ] && selected=yes ;; esac
done
status=0
python -m pytest -q "$@" || status=$?
if [ "$selected" = yes ]; then
  echo "newest megatron-core leg not run (a selection was given): bash scripts/test_latest_megatron.sh"
  exit "$status"
fi
echo "== the newest supported megatron-core =="
latest=0
bash scripts/test_latest_megatron.sh "$@" || latest=$?
# pytest's 5 (nothing collected) from either leg must stay visible to .ci/run
exit $(( status != 0 ? status : latest ))
