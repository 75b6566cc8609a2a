#!/usr/bin/env bash
# The newest end of the supported megatron-core range (issue 31) in its own venv (.venv-latest, made by
# `scripts/setup.sh latest`: Python >= 3.12, megatron-core $MEGATRON_CORE_LATEST). It runs the version tests and
# tests/latest: every feature the fingerprints serve on this release passes check against unpatched Megatron
# there, and every other one refuses naming the changed function.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
bash scripts/setup.sh latest || status=$?
if [ "$status" = 2 ]; then
  # no Python >= 3.12: CI (.ci/run) requires the leg; elsewhere the 0.16.1 suite stands alone, with the line saying so
  [ "${MM_ADAPTOR_REQUIRE_LATEST:-0}" = 1 ] && exit 1 || exit 0
fi
[ "$status" = 0 ] || exit "$status"
VENV=${MM_ADAPTOR_LATEST_VENV:-.venv-latest}
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/latest tests/unit/test_version_fingerprints.py \
  tests/unit/test_megatron_0_19_ports.py "$@"
