#!/usr/bin/env bash
# Create .venv with the CPU build of PyTorch, megatron-core 0.16.x and mm_adaptor (editable) with the test and vlm extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
# Install torch first so the dependency resolver keeps this build (no CUDA wheel is pulled in).
python -c "import torch" 2>/dev/null || python -m pip install -q "$TORCH_SPEC"
python -m pip install -q -e ".[test,vlm]"
