#!/usr/bin/env bash
# Set up a venv with mm_adaptor (editable) and its test and vlm extras (idempotent).
#   bash scripts/setup.sh          .venv: python3 (3.10/3.11), the local CPU build of PyTorch, megatron-core 0.16.1
#                                  (the newest release for Python < 3.12), transformers 4.57.6 ($TRANSFORMERS_SPEC);
#                                  the base the suite runs on.
#   bash scripts/setup.sh latest   .venv-latest: a Python >= 3.12, the registry's torch, the newest megatron-core
#                                  pyproject.toml allows ($MEGATRON_CORE_LATEST, default 0.19.2): 0.17+ ship for
#                                  Python >= 3.12 only; the newest transformers ($TRANSFORMERS_LATEST_SPEC, default
#                                  transformers==5.24.0), so that the vlm extra's two majors (>=4.57,<6) both run.
#   bash scripts/setup.sh npu-torch  .venv-npu-torch: python3 (3.10/3.11), the oldest torch the NPU backend claims
#                                  ($NPU_TORCH_SPEC, default torch==2.6.0: torch_npu pairs with torch 2.5 to 2.9, and
#                                  megatron-core 0.16 requires torch>=2.6), megatron-core 0.16.1; scripts/test.sh's
#                                  NPU leg. The registry's torch: a CUDA build, 5.6 GB with the nvidia libraries it
#                                  does not import without (PyTorch's CPU-wheel index is out of reach).
set -euo pipefail
cd "$(dirname "$0")/.."
# No wheel cache: the two CUDA builds of torch would leave GBs of wheels in the cache beside their venvs, and a clean CI
# machine ran out of disk installing the third venv (2026-11-29). MM_ADAPTOR_PIP_CACHE=1 keeps pip's and uv's caches.
[ "${MM_ADAPTOR_PIP_CACHE:-0}" = 1 ] || export PIP_NO_CACHE_DIR=1  # pip reads any value, even 0, as no cache
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# lora (peft, and accelerate with it) stays out of the NPU leg: accelerate imports torch_npu wherever it finds one,
# and the fake one's strictness probes must see the trainer's own first import
EXTRAS=${MM_ADAPTOR_EXTRAS:-test,vlm,lora}
TRANSFORMERS_SPEC=${TRANSFORMERS_SPEC:-transformers==4.57.6}  # the 4.x major (the 0.16.1 legs)

# A Python >= 3.12: $PYTHON312, else python3.12/python3.13 on PATH, else one pyenv installed but did not activate.
find_python312() {
  local candidate
  for candidate in ${PYTHON312:-} python3.12 python3.13 $(ls -d "$(pyenv root 2>/dev/null)"/versions/3.1[2-9]*/bin/python3 2>/dev/null); do
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then echo "$candidate"; return; fi
  done
}

if [ "${1:-}" = latest ]; then
  VENV=${MM_ADAPTOR_LATEST_VENV:-.venv-latest}
  MEGATRON_SPEC="megatron-core==${MEGATRON_CORE_LATEST:-0.19.2}"
  TRANSFORMERS_SPEC=${TRANSFORMERS_LATEST_SPEC:-transformers==5.24.0}  # the 5.x major
  PYTHON=$(find_python312)
  if [ -z "$PYTHON" ]; then
    echo "setup.sh latest: no Python >= 3.12 found (megatron-core 0.17+ needs it; set PYTHON312)" >&2
    exit 2
  fi
elif [ "${1:-}" = npu-torch ]; then
  VENV=.venv-npu-torch
  MEGATRON_SPEC="megatron-core==0.16.1"
  PYTHON=${PYTHON:-python3}
  TORCH_SPEC=${NPU_TORCH_SPEC:-torch==2.6.0}
  # no vlm extra: the leg's files train GPT models (transformers is imported by none of them; its 38 tests passed
  # with transformers, PIL, av and safetensors made unimportable, and pyyaml, which came with transformers, is the
  # test extra's), and without it the rank server skips Megatron's tokenizers, which import transformers (seconds)
  EXTRAS=${MM_ADAPTOR_EXTRAS:-test}
else
  VENV=.venv
  MEGATRON_SPEC="megatron-core==0.16.1"
  PYTHON=${PYTHON:-python3}
fi

start=$(date +%s)
created=no
[ -x "$VENV/bin/python" ] || { "$PYTHON" -m venv "$VENV"; created=yes; }
# The installs run uv (the registry's): it downloads in parallel and compiles the bytecode on every core; torch 2.13
# with its CUDA libraries took pip 56 s and uv 29 s here, from empty caches. uv does not read pip's configuration:
# the index, extra indexes, find-links and constraints pip would use (`pip config list`) are passed on, and every
# index is searched for the best match, as pip does. MM_ADAPTOR_INSTALLER=pip installs with pip instead.
# MM_ADAPTOR_LAZY_BYTECODE=1 (the test command, which lets Python write the bytecode of what it imports): none for
# the packages' files (compiling .venv-latest's 11,874 took 42 s of CPU; the suite imports 42% of them)
lazy=no
[ "${MM_ADAPTOR_LAZY_BYTECODE:-0}" = 1 ] && lazy=yes
if [ "${MM_ADAPTOR_INSTALLER:-uv}" = uv ]; then
  compile=(--compile-bytecode)
  [ "$lazy" = yes ] && compile=()
  [ -x "$VENV/bin/uv" ] || "$VENV/bin/python" -m pip install -q "${UV_SPEC:-uv==0.13.9}"
  mapfile -t UV_OPTIONS < <("$VENV/bin/python" scripts/uv_options.py)
  install() {
    # no cache kept: uv unpacks into one inside the venv, on its disk, and hard-links the files in from there
    local cache=(--cache-dir "$VENV/.uv-cache") status=0
    [ "${MM_ADAPTOR_PIP_CACHE:-0}" = 1 ] && cache=()
    "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" ${compile[@]+"${compile[@]}"} \
      ${cache[@]+"${cache[@]}"} ${UV_OPTIONS[@]+"${UV_OPTIONS[@]}"} "$@" || status=$?
    rm -rf "$VENV/.uv-cache"
    return "$status"
  }
else
  compile=()
  [ "$lazy" = yes ] && compile=(--no-compile)
  install() { "$VENV/bin/python" -m pip install -q ${compile[@]+"${compile[@]}"} "$@"; }
fi
# torch first, so the resolver keeps this build (the local CPU wheel for 3.11; a registry wheel for 3.12 and for
# npu-torch); a torch other than torch==X installs X over it
torch_ok="import sys, torch; s = sys.argv[1]; sys.exit('==' in s and torch.__version__.split('+')[0] != s.split('==')[1])"
"$VENV/bin/python" -c "$torch_ok" "$TORCH_SPEC" 2>/dev/null || install "$TORCH_SPEC"
# the vlm extra allows transformers 4.57 to 5.x: each leg pins the major it exercises
case ",$EXTRAS," in *,vlm,*) PINNED=("$TRANSFORMERS_SPEC") ;; *) PINNED=() ;; esac
# The editable install writes mm_adaptor.egg-info into this checkout: venvs set up at once take turns here (their
# torch downloads, above, overlap)
exec 9>"${TMPDIR:-/tmp}/mm-adaptor-setup-$(printf %s "$PWD" | cksum | cut -d' ' -f1).lock"
command -v flock >/dev/null && flock 9
install "$MEGATRON_SPEC" ${PINNED[@]+"${PINNED[@]}"} -e ".[$EXTRAS]"
exec 9>&-
# transformers' video processors need torchvision (tests compare the video pixels with theirs on the newest leg):
# the build for this torch, without dependencies (they could replace torch)
if [ "${1:-}" = latest ]; then
  "$VENV/bin/python" -c "import torchvision" 2>/dev/null ||
    install --no-deps "${TORCHVISION_SPEC:-torchvision==0.28.0}"
fi
# Bytecode for this checkout's sources: where PYTHONDONTWRITEBYTECODE is set (this machine and CI), every command and
# rank otherwise compiles them again on import (a subprocess-heavy test file ran 12% faster with it); Python checks
# each file's timestamp, so an edited source is compiled afresh.
"$VENV/bin/python" -m compileall -q mm_adaptor tests benchmarks scripts >/dev/null
[ "$created" = no ] || echo "set up $VENV ($("$VENV/bin/python" --version), $MEGATRON_SPEC) in $(( $(date +%s) - start )) s" >&2
