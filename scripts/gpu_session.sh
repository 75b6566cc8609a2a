#!/usr/bin/env bash
# Everything issue 12 needs a GPU for, in one run on a CUDA machine without network access: build the CUDA
# ops, run the op tests on CUDA, train and check on one GPU, and measure the ops' bandwidth.
#   bash scripts/gpu_session.sh [OUTPUT_DIR]
# Wheels the machine lacks (megatron-core for its Python, liger-kernel to compare against) are read from .whl/
# when present (python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl NAME).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-results}}
mkdir -p "$out"
site=/tmp/mm-adaptor-site
export PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date +%T))"; }

step "install"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$site" . || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

status=0
run() {  # run NAME COMMAND...: output to $out/NAME.log, failures counted
    local name=$1; shift
    step "$name: $*"
    "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "$name exit $rc" | tee -a "$out/summary.txt"
    [ "$rc" -eq 0 ] || status=1
}

run report python3 -m mm_adaptor.cli report
run build python3 -m mm_adaptor.cli build-ops --device cuda
run ops_tests python3 -m pytest -q -p no:cacheprovider tests/ops/test_ops.py tests/ops/test_every_op_on_every_device.py -rs
run train python3 -m mm_adaptor.cli train --nproc-per-node 1 --train-iters 20 --normalization RMSNorm --swiglu \
    --position-embedding-type rope --use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb --use-flash-attn
run check python3 -m mm_adaptor.cli check --layout single --use-fused-rmsnorm --use-fused-swiglu \
    --use-fused-rotary-pos-emb --use-flash-attn --normalization RMSNorm --swiglu --position-embedding-type rope
run check_gmm python3 -m mm_adaptor.cli check --layout single --use-fused-gmm --num-experts 4 --disable-bias-linear \
    --swiglu --moe-grouped-gemm
run ops_bench python3 benchmarks/ops.py --device cuda
echo "exit status $status; logs in $out"
exit $status
