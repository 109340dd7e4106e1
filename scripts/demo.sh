#!/usr/bin/env bash
# The main job: TorchRec's DLRM on Criteo-format data (the seed's train_dlrm.py), 2 simulated nodes x 1
# process with the embedding tables sharded by TorchRec's planner, on a synthetic Criteo dataset whose best
# achievable AUC is known; then the same job evicted mid-run, requeued and resumed from its last
# checkpoint, ending with the very same parameters; last, the trained job exported to a Triton model repository,
# served by azulite serve and scored over HTTP and gRPC with tritonclient.
set -euo pipefail
cd "$(dirname "$0")/.."
id_of() { python -c 'import json,sys; print(json.loads(sys.stdin.readline())["id"])'; }
hash_of() { azulite job logs "$1" --rank 0 | grep -o 'final_params_sha256=[0-9a-f]*' | tail -1; }
data=.cache/criteo-synth   # examples/dlrm/job.yaml's inputs.dataset

echo "== 1. a synthetic Criteo dataset: 2 files x 4000 rows of real-format TSV with a planted click signal"
[[ -f $data/synthetic.json ]] || python -m azulite.data.criteo_synth "$data" --rows 4000 --files 2 --seed 0
head -c 160 "$data/day_0"; echo " ..."

echo
echo "== 2. DLRM, 2 nodes x 1 process, tables sharded across the ranks, checkpointing every 20 steps"
job=$(azulite job submit examples/dlrm/job.yaml --json | id_of)
# rank 0's progress as it trains (the log ends when the job does)
azulite job logs "$job" --rank 0 --follow \
  | grep --line-buffered -E '^(rank 0/|step |held-out|trained|checkpoint:|resumed|no checkpoint)' || true
azulite job wait "$job" >/dev/null   # exits with the job's outcome: 0 = succeeded
echo
echo "every rank's last line (a hash of all the ranks' shards: identical on every rank):"
azulite job logs "$job" | grep final_params_sha256

echo
echo "== 3. the same job, preempted (a spot eviction) after its first checkpoint"
job2=$(azulite job submit examples/dlrm/job.yaml --set inputs.step_sleep=0.05 --json | id_of)
azulite job wait "$job2" --checkpoint --timeout 300
azulite job preempt "$job2"        # SIGTERM: every rank finishes its step, commits it, exits 75 -> requeued
azulite job wait "$job2" >/dev/null
azulite job show "$job2"
azulite job logs "$job2" --rank 0 | grep -E "^(resumed from step|held-out)"   # all of the log is read: no SIGPIPE under pipefail
echo
a=$(hash_of "$job")
b=$(hash_of "$job2")
echo "uninterrupted: $a"
echo "preempted:     $b"
[[ $a == "$b" ]] && echo "identical: the resumed run is indistinguishable from one that never stopped" \
  || { echo "MISMATCH: the resumed run diverged" >&2; exit 1; }

echo
echo "== 4. from checkpoint to endpoint: export the job, serve it, score held-out raw Criteo rows"
bash scripts/demo_serve.sh "$job"
