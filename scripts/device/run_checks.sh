#!/bin/bash
# The device check, run from the repository root on the lent GPU machine: bash .devkit/run_checks.sh [quick]
# (source: scripts/device/run_checks.sh; build_kit.sh copies it into .devkit/). Stages, each logged into $OUT:
#   setup (.devkit/setup.sh, preflight off unless KIT_PREFLIGHT=1), azulite doctor, the CUDA/system shm tests,
#   then (not with "quick") bench-a: Triton vs azulite serve --workers 1 2 4 at c=1 8 32, and bench-b: azulite
#   only at c=64 with 1 2 4 8 workers, in what is left of ~560 s. Adapt the stages to what a session must learn.
set -u
export PYTHONUNBUFFERED=1 COLUMNS=200
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
stage() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stage setup
KIT_PREFLIGHT=${KIT_PREFLIGHT:-0} bash .devkit/setup.sh > "$OUT/setup.log" 2>&1; rc=$?; echo "setup rc=$rc"; tail -12 "$OUT/setup.log"
[ -d /tmp/kit-preflight-logs ] && cp -r /tmp/kit-preflight-logs "$OUT/"
[ "$rc" = 0 ] || exit "$rc"
export PATH=${KIT_VENV:-/tmp/v}/bin:$PATH  # setup.sh's venv (KIT_VENV as it was given)
nproc; nvidia-smi -L 2>&1 | head -2; python -c 'import sys; print(sys.executable, sys.version.split()[0])'
python -c 'from azulite.serve import cuda_shm; print("cuda_shm.available:", cuda_shm.available())'

stage doctor
timeout 30 azulite doctor > "$OUT/doctor.log" 2>&1; echo "doctor rc=$?"; head -40 "$OUT/doctor.log"

stage cuda-tests
timeout 170 python -m pytest -q -p no:cacheprovider --timeout 150 -rs tests/serve/test_cuda_shm.py tests/serve/test_shm.py \
  > "$OUT/cuda_tests.log" 2>&1; echo "cuda tests rc=$?"; pkill -f "azulite serve"; pkill -f tritonserver; grep -E "passed|failed|error|FAILED|ERROR|SKIPPED" "$OUT/cuda_tests.log" | tail -25

[ "${1:-}" = quick ] && { stage done; exit 0; }

stage bench-a
timeout 270 python bench/serving.py --workers --anchors "${KIT_TRITON:-/tmp/triton}" --concurrency 1 8 32 --measure-ms 1000 --serve-workers 1 2 4 --no-twins \
  --load-cores 4 --server-cores rest > "$OUT/bench_a.log" 2>&1; echo "bench-a rc=$?"
grep -E "^  (triton|azulite)" "$OUT/bench_a.log" | cut -c1-150
tail -1 "$OUT/bench_a.log" > "$OUT/bench_a.json"
pkill -f "azulite serve"; pkill -f tritonserver; pkill -f triton_python_backend_stub; sleep 1

stage bench-b
left=$(( 560 - ($(date +%s) - t0) )); echo "left for bench-b: $left s"
[ "$left" -gt 60 ] && timeout "$left" python bench/serving.py --workers --anchors "${KIT_TRITON:-/tmp/triton}" --concurrency 64 --measure-ms 1000 --serve-workers 1 2 4 8 --no-twins \
  --load-cores 4 --server-cores rest --protocols http --no-triton > "$OUT/bench_b.log" 2>&1; echo "bench-b rc=$?"
grep -E "^  (triton|azulite)" "$OUT/bench_b.log" | cut -c1-150
tail -1 "$OUT/bench_b.log" > "$OUT/bench_b.json"

stage summary
python scripts/device/bench_summary.py bench_a bench_b

stage done
