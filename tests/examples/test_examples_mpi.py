"""examples/mpi: mpi4py allreduce SGD under mpirun, 2 ranks; every rank ends with the same weights, and a run
preempted mid-way (SIGTERM to each rank's group, an allreduce agreeing on the step, rank 0's save, exit 75)
is requeued, resumes from the saved step and ends with the weights of the run that never stopped."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from tests.examples.runner import az, final_hashes, run_example
from tests.launch.jobkit import home, wait_for

_ = home  # fixture
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
                       reason="Open MPI (mpirun) or mpi4py not installed"),
]


def test_mpi_example(home):
    rec = run_example("mpi", "inputs.steps=20")
    logs = rec["rank_logs"]
    assert sorted(logs) == [0, 1]
    hashes = final_hashes(rec)
    assert len(set(hashes.values())) == 1, hashes
    assert "rank 0/2" in logs[0] and "rank 1/2" in logs[1] and "Open MPI" in logs[0]
    assert "step 20 loss" in logs[0] and "step 30 " not in logs[0]
    assert "checkpoint: step 20 saved" in logs[0] and "resumed" not in logs[0]
    assert not [r for r, text in logs.items() if "\0" in text]  # text, not "binary file matches" to grep


def test_a_preempted_mpi_run_resumes_and_ends_with_the_uninterrupted_weights(home):
    reference = set(final_hashes(run_example("mpi", "inputs.steps=60")).values())
    # 0.2 s a step: the first save comes after ~2 s and the run would end ~10 s later, room for the CLI's
    # preempt to land on a loaded machine (it must find the job running)
    p = az("job", "submit", "examples/mpi/job.yaml", "--json", "--set", "inputs.steps=60",
           "--set", "inputs.step_sleep=0.2")
    assert p.returncode == 0, p.stdout + p.stderr
    job = json.loads(p.stdout)
    log0 = Path(job["job_dir"]) / "attempt-1" / "logs" / "rank-0.log"
    wait_for(lambda: log0.exists() and "checkpoint: step 10 saved" in log0.read_text(), 120, "the first save")
    p = az("job", "preempt", job["id"])
    assert p.returncode == 0, p.stderr  # 2 if the job had already ended
    p = az("job", "wait", job["id"], "--json", "--timeout", "300")
    rec = json.loads(az("job", "show", job["id"], "--json").stdout)
    assert rec["state"] == "succeeded", rec["reason"]
    assert [(a["attempt"], a["state"]) for a in rec["attempts"]] == [(1, "requeued"), (2, "succeeded")]
    first = {x["rank"]: x["exit_code"] for x in rec["processes"] if x["kind"] == "rank" and x["attempt"] == 1}
    assert first == {0: 75, 1: 75}, first  # both ranks saved and exited 'preempted', none killed by mpirun
    logs = {x["rank"]: Path(x["log"]).read_text() for x in rec["processes"]
            if x["kind"] == "rank" and x["attempt"] == 2}
    stopped = int(log0.read_text().split("preempted after step ", 1)[1].split(":")[0])
    assert 10 <= stopped < 60 and f"checkpoint: step {stopped} saved" in log0.read_text()
    assert f"resumed from step {stopped}" in logs[0]
    assert {text.strip().splitlines()[-1].split("=", 1)[1] for text in logs.values()} == reference
