#!/usr/bin/env bash
# The newest end of the supported megatron-core range (issue 31) in its own venv (.venv-latest, made by
# `scripts/setup.sh latest`: Python >= 3.12, megatron-core $MEGATRON_CORE_LATEST): the whole suite, or the pytest
# selection given. Exits 2 where no Python >= 3.12 is found.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh latest
VENV=${MM_ADAPTOR_LATEST_VENV:-.venv-latest}
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
