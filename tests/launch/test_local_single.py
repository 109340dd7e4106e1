"""Jobs without `distribution`: the command runs once per node, with no distributed env contract."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from azulite.spec.loader import load_job
from tests.launch.jobkit import REPO, backend, home, wait_done, write_job

_ = home

DUMP = """
import json, os
keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "AZULITE_RANK", "AZUREML_NODE_COUNT")
out = os.environ["AZULITE_OUTPUT_OUT"]
with open(os.path.join(out, f"node-{os.environ['AZULITE_RANK']}.json"), "w") as f:
    json.dump({k: os.environ.get(k) for k in keys} | {"cwd": os.getcwd()}, f)
"""

SPEC = """
name: plain
code: .
command: python run.py
resources: {instance_count: 2}
outputs: {out: {type: uri_folder}}
"""


@pytest.mark.slow
def test_a_job_without_distribution_runs_the_command_once_per_node_without_a_process_group(home, tmp_path):
    spec = write_job(tmp_path / "p", DUMP, SPEC)
    p = subprocess.run([str(Path(sys.executable).parent / "azulite"), "job", "validate", str(spec)],
                       capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0 and "none 2 node(s)" in p.stdout, p.stdout + p.stderr
    rec = wait_done(backend().submit(load_job(spec)).id)
    assert rec.state.value == "succeeded", rec.reason
    out = Path(rec.job_dir) / "outputs" / "out"
    seen = {f.name: json.loads(f.read_text()) for f in sorted(out.glob("node-*.json"))}
    assert set(seen) == {"node-0.json", "node-1.json"}
    for node, env in enumerate(seen.values()):
        assert env["AZULITE_RANK"] == str(node) and env["AZUREML_NODE_COUNT"] == "2"
        assert all(env[k] is None for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")), env
    assert len({env["cwd"] for env in seen.values()}) == 2  # each node in its own working dir
    ranks = sorted((p.rank, p.node, p.exit_code) for p in rec.processes if p.kind == "rank")
    assert ranks == [(0, 0, 0), (1, 1, 0)]


KILLED = """
import os, signal
if os.environ["AZULITE_RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends a process
"""


def test_a_command_killed_by_a_signal_is_its_ranks_failure_not_a_lost_node(home, tmp_path):
    """Without distribution (as under mpi and tensorflow) each node's agent is its rank's runner, which exits
    with its command's code: a command killed with SIGKILL was reported as node-1's agent lost."""
    spec = write_job(tmp_path / "k", KILLED, SPEC.replace("name: plain", "name: killed"))
    rec = wait_done(backend().submit(load_job(spec)).id)
    assert rec.state.value == "failed" and rec.exit_code == 137, (rec.state, rec.exit_code, rec.reason)
    assert rec.reason.startswith("rank 1 (node 1) exited 137") and "lost" not in rec.reason, rec.reason
