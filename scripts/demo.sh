#!/usr/bin/env bash
# The main job: a real distributed DDP run (2 simulated nodes x 2 processes, torchrun agents, gloo on CPU)
# on this machine, then its summary from the job store.
set -euo pipefail
cd "$(dirname "$0")/.."
# --wait follows the job to its end (state changes on stderr, the summary on stdout) and exits with its
# outcome: 0 = succeeded
azulite job submit examples/ddp/job.yaml --wait
job=$(azulite job list --json --limit 1 | python -c 'import json,sys; print(json.loads(sys.stdin.readline())["id"])')
echo
echo "every rank's last line (identical parameters after DDP):"
azulite job logs "$job" | grep final_params_sha256
