#!/bin/bash
# The serving bench alone on a lent machine (16 cores): bash scripts/device/run_bench.sh, carry [".whl", ".devkit"].
# Stage A: Triton beside azulite serve --workers 1 2 4 at c=32/64/128 over HTTP and gRPC (perf_analyzer on 4
# cores, the servers on the rest); stage B, in what is left of ~540 s: --workers 8 at c=128 (azulite only).
# Each stage's last line (its JSON) is kept in $OUT; a stage cut off by its timeout loses only itself.
# A_ARGS / B_ARGS (environment) replace a stage's concurrency and worker counts; B_ARGS=none skips stage B.
set -u
export PYTHONUNBUFFERED=1 COLUMNS=200
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
stage() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stage setup
KIT_PREFLIGHT=0 bash .devkit/setup.sh > "$OUT/setup.log" 2>&1; rc=$?; echo "setup rc=$rc"; tail -5 "$OUT/setup.log"
[ "$rc" = 0 ] || exit "$rc"
export PATH=${KIT_VENV:-/tmp/v}/bin:$PATH
nproc
bench() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  stage "$name ($limit s)"
  timeout "$limit" python bench/serving.py --workers --anchors "${KIT_TRITON:-/tmp/triton}" --measure-ms 1000 --no-twins \
    --load-cores 4 --server-cores rest "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?"
  grep -E "^  (triton|azulite)" "$OUT/$name.log" | cut -c1-160
  tail -1 "$OUT/$name.log" > "$OUT/$name.json"
  pkill -f "azulite serve"; pkill -f tritonserver; pkill -f triton_python_backend_stub; sleep 1
}
# A_ARGS / B_ARGS replace each stage's own arguments (e.g. A_ARGS="--concurrency 1 8 --serve-workers 1 2")
# shellcheck disable=SC2086
bench bench_a 400 ${A_ARGS:---concurrency 32 64 128 --serve-workers 1 2 4}
left=$(( 540 - ($(date +%s) - t0) )); echo "left for bench_b: $left s"
# shellcheck disable=SC2086
[ "$left" -gt 60 ] && [ "${B_ARGS:-}" != none ] && bench bench_b "$left" ${B_ARGS:---concurrency 128 --serve-workers 1 8 --no-triton}
stage summary
python scripts/device/bench_summary.py bench_a bench_b

stage done
