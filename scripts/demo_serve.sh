#!/usr/bin/env bash
# The end of the demo: a trained DLRM job -> a Triton model repository -> azulite serve -> Triton's clients.
#   scripts/demo_serve.sh JOB_ID [REPOSITORY]     (REPOSITORY default: a fresh temporary folder)
# Exports the job's newest checkpoint (its shards gathered into one model, verified against PyTorch),
# serves the repository on free ports, scores held-out raw Criteo rows over HTTP and gRPC with tritonclient,
# prints the served scores beside the PyTorch model's and the served AUC, and stops the server.
set -euo pipefail
cd "$(dirname "$0")/.."
job=${1:?usage: scripts/demo_serve.sh JOB_ID [REPOSITORY]}
work=$(mktemp -d)
repo=${2:-$work/model_repository}
server=
cleanup() {
  if [[ -n $server ]]; then kill -TERM "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

echo "== export: $job's newest checkpoint -> $repo"
azulite export "$job" --to "$repo" --name dlrm --json > "$work/export.json"
python - "$work/export.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
v = r["verification"]
served = ("ensemble dlrm = dlrm_preprocess -> dlrm_model" if r["pipeline"] == "ensemble"
          else "dlrm = one Python step parsing the raw rows and running the model with onnxruntime")
print(f"exported {r['checkpoint']} as {r['format']}: {served} (version {r['version']})")
print(f"verified against PyTorch: max abs error {v['max_abs_error']:.3g}, max rel error {v['max_rel_error']:.3g} "
      f"on {v['rows']} rows")
PY

echo
echo "== azulite serve $repo"
azulite serve "$repo" --http-port 0 --grpc-port 0 --metrics-port 0 --http-address 127.0.0.1 \
  --grpc-address 127.0.0.1 --metrics-address 127.0.0.1 > "$work/serve.log" 2>&1 &
server=$!
for _ in $(seq 1200); do  # up to 120 s for the models to load
  grep -q "azulite serve ready" "$work/serve.log" && break
  kill -0 "$server" 2>/dev/null || { cat "$work/serve.log" >&2; exit 1; }
  sleep 0.1
done
grep -q "azulite serve ready" "$work/serve.log" || { cat "$work/serve.log" >&2; exit 1; }
http=$(grep -o 'Started HTTPService at [0-9.]*:[0-9]*' "$work/serve.log" | grep -o '[0-9]*$')
grpc=$(grep -o 'Started GRPCInferenceService at [0-9.]*:[0-9]*' "$work/serve.log" | grep -o '[0-9]*$')
echo "serving on HTTP :$http and gRPC :$grpc"

echo
echo "== score held-out rows through tritonclient"
ckpt=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["checkpoint"])' "$work/export.json")
python scripts/demo_serve.py "$job" "$http" "$grpc" "$ckpt"
