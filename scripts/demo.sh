#!/usr/bin/env bash
# The main job: a real distributed DDP run (2 simulated nodes x 2 processes, torchrun agents, gloo on CPU)
# on this machine with checkpoints, then the same job evicted mid-run, requeued and resumed from its last
# checkpoint, ending with the very same parameters.
set -euo pipefail
cd "$(dirname "$0")/.."
id_of() { python -c 'import json,sys; print(json.loads(sys.stdin.readline())["id"])'; }
hash_of() { azulite job logs "$1" --rank 0 | grep -o 'final_params_sha256=[0-9a-f]*' | tail -1; }

echo "== 1. DDP, 2 nodes x 2 processes, checkpointing every 10 steps"
# --wait follows the job to its end (state changes on stderr, the summary on stdout) and exits with its
# outcome: 0 = succeeded
azulite job submit examples/ddp/job.yaml --wait
job=$(azulite job list --json --limit 1 | id_of)
echo
echo "every rank's last line (identical parameters after DDP):"
azulite job logs "$job" | grep final_params_sha256

echo
echo "== 2. the same job, preempted (a spot eviction) after its first checkpoint"
job2=$(azulite job submit examples/ddp/job.yaml --set inputs.step_sleep=0.2 --json | id_of)
azulite job wait "$job2" --checkpoint --timeout 300
azulite job preempt "$job2"        # SIGTERM: every rank finishes its step, commits it, exits 75 -> requeued
azulite job wait "$job2" >/dev/null
azulite job show "$job2"
azulite job logs "$job2" --rank 0 | grep "^resumed from step"   # all of the log is read: no SIGPIPE under pipefail
echo
a=$(hash_of "$job")
b=$(hash_of "$job2")
echo "uninterrupted: $a"
echo "preempted:     $b"
[[ $a == "$b" ]] && echo "identical: the resumed run is indistinguishable from one that never stopped" \
  || { echo "MISMATCH: the resumed run diverged" >&2; exit 1; }
