#!/usr/bin/env bash
# The test command; it sets up what it needs (idempotent). Both ends of the supported megatron-core range:
#  1. the newest release (.venv-latest: Python >= 3.12, scripts/test_latest_megatron.sh): the whole suite;
#  2. megatron-core 0.16.1 (.venv: Python 3.11, the local CPU torch, transformers 4.57): tests/unit, every feature's
#     check against unpatched Megatron in one layout (tests/distributed/test_every_feature_on_installed_megatron.py)
#     and the VLMs' logits against transformers 4.57;
#  3. the NPU backend on the oldest torch it claims (.venv-npu-torch, `scripts/setup.sh npu-torch`: torch 2.6.0,
#     megatron-core 0.16.1): the tests/npu files where torch's version changes what runs (NPU_TORCH_LEG).
# Without a Python >= 3.12 the whole suite runs on 0.16.1 instead, with a line saying so (CI requires both legs).
# Pytest arguments pass through; a selection (-m, -k or a path), e.g. `bash scripts/test.sh -m "not distributed"`,
# runs on the newest release only (on 0.16.1 where there is no Python >= 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
selected=no
for arg in "$@"; do
  case "$arg" in -m|-k|-m*|-k*) selected=yes ;; *) [ -e "${arg%%::*}" ] && selected=yes ;; esac
done
# + the NPU process-group test: torch_npu installs beside a CPU build of torch, which only this venv has
# + transformers 4.57 (the newest leg runs 5.x): both VLM families' TP1 logits against it and the configs each
#   major saves
# + InternVL's logits against transformers 4.57 as well
# - the benchmarks' smoke runs (tests/unit/test_benchmarks_run.py, about 70 s quiet): they run on the newest release; on
#   0.16.1 the features they drive are checked by test_every_feature_on_installed_megatron.py
# - what does not touch megatron-core (about 150 s of CI's 2 cores): the launcher and its ranks' start and exit, the
#   command lines refused before torch is imported, the one-line import's excepthook (test_errors.py) and the
#   CPU backend's refusal of an NCCL group without a GPU (torch's and ours): each a fresh interpreter, 4-5 s
BASE_LEG=(tests/unit tests/distributed/test_every_feature_on_installed_megatron.py tests/distributed/test_known_megatron_bugs.py
          tests/npu/test_npu_process_groups.py
          tests/models/test_qwen2_5_vl_logits.py tests/models/test_qwen3_vl_logits.py tests/models/test_qwen3_vl_positions.py
          tests/convert/test_config_spellings.py tests/models/test_internvl_logits.py tests/models/test_lora_logits.py
          --ignore=tests/unit/test_benchmarks_run.py --ignore=tests/unit/test_rank_start.py
          --ignore=tests/unit/test_launcher_and_args.py --ignore=tests/unit/test_rank_exit.py
          --ignore=tests/unit/test_command_line_errors.py --ignore=tests/unit/test_errors.py
          --deselect tests/unit/test_megatron_lm_hooks.py::test_nccl_without_a_gpu_stops_right_after_validation_with_one_line)
# torch_npu pairs with torch 2.5 to 2.9 (megatron-core 0.16 needs 2.6), the other legs run 2.13: what depends on
# torch's version under the NPU backend (collectives and the torch-function mode, the RNG and its generators, the
# compile stance, the fake device's hooks and custom ops) runs again on 2.6 here, through the training runs' loss
# lines, the process groups and HCCL collectives, the fake device, the fused ops and the compile stance. Left to
# the newest leg: the feature checks (test_npu_check.py; the training runs cover its layouts) and the fake's op
# argument rules (the *_rules.py and attention-mask files: the fake's own Python, not torch's).
NPU_TORCH_LEG=(tests/npu/test_npu_training.py tests/npu/test_npu_process_groups.py tests/npu/test_fake_device.py
               tests/npu/test_fake_npu_ops.py tests/npu/test_compile_stance.py tests/npu/test_npu_fidelity.py
               tests/npu/test_global_tokens.py)

on_base() {
  bash scripts/setup.sh >/dev/null
  MM_ADAPTOR_TEST_LEG=0.16.1 .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
}

LATEST_PYTHON=${MM_ADAPTOR_LATEST_VENV:-.venv-latest}/bin/python
on_newest() {  # .venv-latest is set up first (setup.sh latest, below)
  MM_ADAPTOR_TEST_LEG=newest "$LATEST_PYTHON" -m pytest -q -p no:cacheprovider "$@"
}

on_npu_torch() {
  bash scripts/setup.sh npu-torch >/dev/null
  local version
  version=$(.venv-npu-torch/bin/python -c "import importlib.metadata as m; print(m.version('torch'))")
  MM_ADAPTOR_TEST_LEG="npu-torch-$version" .venv-npu-torch/bin/python -m pytest -q -p no:cacheprovider "$@"
}

# Bytecode: the venvs' installs compile none (setup.sh), the tests' processes write it for what they import, once
# (42% of the packages' files; PYTHONDONTWRITEBYTECODE, set on this machine and CI, would have every process
# compile them again)
export MM_ADAPTOR_LAZY_BYTECODE=1
unset PYTHONDONTWRITEBYTECODE

# The time guard (scripts/time_budget.py): the whole command's seconds and each leg's seconds per test file.
started=$(date +%s)
export MM_ADAPTOR_TEST_TIMES=${MM_ADAPTOR_TEST_TIMES:-$(mktemp --suffix=.json)}
rm -f "$MM_ADAPTOR_TEST_TIMES"
time_guard() {
  python3 scripts/time_budget.py "$(( $(date +%s) - started ))" "$MM_ADAPTOR_TEST_TIMES"
}

latest=0
bash scripts/setup.sh latest || latest=$?
if [ "$latest" = 2 ]; then
  if [ "${MM_ADAPTOR_REQUIRE_LATEST:-0}" = 1 ]; then exit 1; fi
  echo "== no Python >= 3.12 for the newest megatron-core: the suite runs on megatron-core 0.16.1 alone =="
  on_base "$@"
  exit
fi
[ "$latest" = 0 ] || exit "$latest"
if [ "$selected" = no ]; then
  echo "== ruff check (ruff.toml) =="
  .venv-latest/bin/ruff check . || exit 1
fi
echo "== the newest supported megatron-core: the whole suite =="
status=0
if [ "$selected" = yes ]; then
  MM_ADAPTOR_TEST_LEG=newest bash scripts/test_latest_megatron.sh "$@" || status=$?
  exit "$status"
fi
# The rest of the suite in two pytest processes side by side: alone, one left about a quarter of CI's two cores
# idle (vmstat: process starts, rendezvous, checkpoint writes, signal waits). One takes tests/ops and
# tests/distributed, the other every other folder; the second starts once the first's opening test is building the
# native CPU ops into the suite's cache (that test builds them from four processes at once and counts one build):
# their lock held, the second's first use of them waits for that build and loads it. (Waiting for the library
# itself left one core idle for the build's minute.)
# The grouped feature checks of test_every_feature_on_installed_megatron.py run on 0.16.1 (their purpose); here
# test_feature_pairs.py trains every feature with every other it accepts, a superset (60 s less).
main=$(mktemp -d)
legs=$(mktemp -d)
# The three last legs (the newest one's tests/unit; the two older ones, which install their environments first)
# start as soon as either process above finishes, beside the other's last minutes: whichever finishes first, no
# core waits for the other, and the legs end together. The older legs' editable installs of this checkout take
# turns (setup.sh); the npu-torch one's torch download runs beside the base leg's set-up and tests. (Installing
# them during the multi-rank tests' first half slowed those by more than the installs take.)
last_legs() {
  mkdir "$legs/started" 2>/dev/null || return 0  # the first process to finish starts them
  # (.venv-latest is set up: no second editable install beside the older ones')
  ( rc=0; on_newest tests/unit "$@" > "$legs/newest.log" 2>&1 || rc=$?
    echo "$rc" > "$legs/newest.rc" ) &
  ( rc=0; bash scripts/setup.sh > "$legs/base.log" 2>&1 || rc=$?
    [ "$rc" = 0 ] && { on_base "${BASE_LEG[@]}" "$@" >> "$legs/base.log" 2>&1 || rc=$?; }
    echo "$rc" > "$legs/base.rc" ) &
  ( rc=0; on_npu_torch "${NPU_TORCH_LEG[@]}" "$@" > "$legs/npu.log" 2>&1 || rc=$?; echo "$rc" > "$legs/npu.rc" ) &
  wait
}
( rc=0; on_newest tests/ops tests/distributed \
    --deselect tests/distributed/test_every_feature_on_installed_megatron.py::test_serving_features_pass_check_here \
    "$@" > "$main/multi-rank.log" 2>&1 || rc=$?
  echo "$rc" > "$main/multi-rank.rc"; last_legs "$@" ) &
# (no path: the second waits for the first to finish)
library=$("$LATEST_PYTHON" -c "from mm_adaptor.ops import builder; print(builder.library_path('cpu'))" 2>/dev/null) ||
  library=""
building() { [ -e "${library%/*}.lock" ] && command -v flock >/dev/null && ! flock -n "${library%/*}.lock" true; }
( until [ -e "$main/multi-rank.rc" ] || [ -e "$library" ] || building; do sleep 1; done
  rc=0; on_newest tests --ignore=tests/unit --ignore=tests/ops --ignore=tests/distributed "$@" \
    > "$main/others.log" 2>&1 || rc=$?
  echo "$rc" > "$main/others.rc"; last_legs "$@" ) &
until [ -e "$main/multi-rank.rc" ] && [ -e "$main/others.rc" ]; do sleep 2; done
echo "-- tests/ops and tests/distributed --"
cat "$main/multi-rank.log"
echo "-- the other folders but tests/unit --"
cat "$main/others.log"
for rc in "$main"/*.rc; do [ "$(cat "$rc")" = 0 ] || status=$(cat "$rc"); done
wait
echo "== the newest supported megatron-core: tests/unit =="
cat "$legs/newest.log"
unit=$(cat "$legs/newest.rc")
echo "== megatron-core 0.16.1: the unit tests and every feature's check in one layout =="
cat "$legs/base.log"
echo "== the NPU backend on the oldest torch it claims: tests/npu where torch's version matters =="
cat "$legs/npu.log"
base=$(cat "$legs/base.rc")
npu=$(cat "$legs/npu.rc")
guard=0
time_guard || guard=$?
# pytest's 5 (nothing collected) from any leg must stay visible to .ci/run
exit $(( status != 0 ? status : unit != 0 ? unit : base != 0 ? base : npu != 0 ? npu : guard ))
