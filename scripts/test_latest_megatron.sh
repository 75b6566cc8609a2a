#!/usr/bin/env bash
# The newest end of the supported megatron-core range (issue 31): megatron-core 0.17+ ships for Python >= 3.12 only,
# so it gets a venv of its own (.venv-latest: python3.12, the registry's torch, megatron-core $MEGATRON_CORE_LATEST,
# mm_adaptor editable). It runs the version tests and tests/latest: every feature the fingerprints serve on this
# release passes check against unpatched Megatron there, and every other one refuses naming the changed function.
set -euo pipefail
cd "$(dirname "$0")/.."
LATEST=${MEGATRON_CORE_LATEST:-0.19.2}
# A Python >= 3.12: $PYTHON312, else python3.12/python3.13 on PATH, else one pyenv has installed but not activated.
find_python312() {
  local candidate
  for candidate in ${PYTHON312:-} python3.12 python3.13 $(ls -d "$(pyenv root 2>/dev/null)"/versions/3.1[2-9]*/bin/python3 2>/dev/null); do
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then echo "$candidate"; return; fi
  done
}
PYTHON312=$(find_python312)
VENV=${MM_ADAPTOR_LATEST_VENV:-.venv-latest}
if [ -z "$PYTHON312" ]; then
  echo "newest megatron-core leg: no Python >= 3.12 found (megatron-core 0.17+ needs it; set PYTHON312)" >&2
  # CI (.ci/run) requires the leg; elsewhere the 0.16.1 suite stands alone, with this line saying so.
  [ "${MM_ADAPTOR_REQUIRE_LATEST:-0}" = 1 ] && exit 1 || exit 0
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('megatron-core') != '$LATEST')" 2>/dev/null; then
  start=$(date +%s)
  "$PYTHON312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q torch==2.13.0 "megatron-core==$LATEST" "wrapt>=1.14" packaging numpy psutil ninja \
    "pytest>=7" "pytest-timeout>=2"
  # --no-deps: pyproject's megatron-core range ends below 0.17 until every feature is verified there.
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  echo "set up $VENV (megatron-core $LATEST) in $(( $(date +%s) - start )) s"
fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/latest tests/unit/test_version_fingerprints.py \
  tests/unit/test_megatron_0_19_ports.py "$@"
