"""Each job's MLflow store: ranks get MLFLOW_TRACKING_URI, rank 0 logs (mlflow's own API or
azulite.train.log_metrics), `job show` / `--json` carry the last value of each metric across attempts,
and a job that logs nothing runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from azulite.errors import MetricsError
from azulite.launch.tracking import STORE_FILE
from azulite.spec.loader import load_job
from azulite.train.metrics import log_metrics
from tests.launch.jobkit import REPO, backend, home, spec_2x1, wait_done, wait_for, write_job

_ = home

# Azure ML style: mlflow.log_metric from rank 0; azulite's log_metrics from every rank (rank 0 logs).
# Attempt 1 fails after logging, attempt 2 (max_retries: 1) logs later values: the last ones win.
LOGGER = """
import os, sys
import mlflow
from azulite import train
rank = int(os.environ["RANK"])
attempt = int(os.environ["AZULITE_ATTEMPT"])
assert os.environ["MLFLOW_TRACKING_URI"].startswith("sqlite:///"), os.environ["MLFLOW_TRACKING_URI"]
for step in range(3):
    if rank == 0:
        mlflow.log_metric("loss", 10.0 * attempt - step, step=step)
    train.log_metrics({"who": 100 + rank, "acc": attempt / 10}, step=step)
print("logged", flush=True)
sys.exit(1 if attempt == 1 else 0)
"""


def az(*args):
    p = subprocess.run([str(Path(sys.executable).parent / "azulite"), *args], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0, (p.stdout, p.stderr)
    return p.stdout


@pytest.mark.slow
def test_rank0_metrics_reach_job_show_last_value_across_attempts(home, tmp_path):
    spec = write_job(tmp_path / "m", LOGGER, spec_2x1(nodes=1, per_node=2, extra="max_retries: 1"))
    rec = backend().submit(load_job(spec))
    rec = wait_done(rec.id)
    assert rec.state.value == "succeeded" and rec.attempt == 2, rec.reason
    shown = json.loads(az("job", "show", rec.id, "--json"))
    assert shown["metrics_error"] is None
    metrics = {k: (v["value"], v["step"]) for k, v in shown["metrics"].items()}
    # attempt 2's values (a new run in the same store) win; only rank 0's "who" was logged; log_metrics
    # measured the time per step between its calls
    step_time, step_time_step = metrics.pop("step_time_s")
    assert step_time > 0 and step_time_step == 2
    assert metrics == {"loss": (18.0, 2), "who": (100.0, 2), "acc": (0.2, 2)}
    text = az("job", "show", rec.id)
    assert "metrics (MLflow)" in text and "18" in text
    assert (Path(rec.job_dir) / STORE_FILE).exists()  # a store with runs stays


@pytest.mark.slow
def test_a_job_that_logs_nothing_runs_and_shows_no_metrics(home, tmp_path):
    spec = write_job(tmp_path / "q", "print('quiet')\n", spec_2x1(nodes=1, per_node=1))
    rec = wait_done(backend().submit(load_job(spec)).id)
    assert rec.state.value == "succeeded", rec.reason
    # the store was ready before the job started; at its end, holding no run, it is removed (a megabyte of
    # MLflow's empty schema per job was kept); the supervisor does it as it exits
    wait_for(lambda: not (Path(rec.job_dir) / STORE_FILE).exists(), 60, "the empty store to be removed")
    shown = json.loads(az("job", "show", rec.id, "--json"))
    assert shown["metrics"] == {} and shown["metrics_error"] is None


def test_log_metrics_rank0_only_and_a_noop_without_a_store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    assert not log_metrics({"loss": 1.0}, step=1, environ={"RANK": "0"})  # no store: a script run by hand
    assert not log_metrics({"loss": 1.0}, step=1, environ={"RANK": "1", "MLFLOW_TRACKING_URI": uri})
    assert not (tmp_path / "m.db").exists()
    with pytest.raises(MetricsError, match="'loss' = 'high' is not a number"):
        log_metrics({"loss": "high"}, environ={"RANK": "0", "MLFLOW_TRACKING_URI": uri})


def test_metric_history_from_the_jobs_own_store_is_what_mlflow_reads(tmp_path, monkeypatch):
    """A sweep's driver reads each trial's objective straight from the trial's SQLite store (no MLflow
    import in the driver): the same values in the same order as MLflow's client gives, NaN included,
    deleted runs and other experiments' and metrics' values left out."""
    import math
    import shutil

    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from azulite.launch import tracking
    from azulite.spec.job import JobSpec

    spec = JobSpec.model_validate({"name": "exp-h", "command": "python train.py", "code": str(tmp_path)})
    shutil.copyfile(tracking._template(), tmp_path / STORE_FILE)
    uri = tracking.store_uri(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment(tracking.experiment_name(spec))
    other = client.create_experiment("another")

    def run(experiment, start, values, key="loss"):
        run_id = client.create_run(experiment, start_time=start).info.run_id
        client.log_batch(run_id, metrics=[Metric(key, v, ts, step) for step, v, ts in values], synchronous=True)
        return run_id

    run(exp, 2000, [(0, 5.0, 1)])  # a later attempt's run: after the first one's values
    run(exp, 1000, [(2, 3.0, 1), (1, 4.0, 2), (3, float("nan"), 3), (2, 2.5, 4)])  # out of step order
    client.delete_run(run(exp, 1500, [(0, 99.0, 1)]))
    run(exp, 1200, [(0, 1.0, 1)], key="acc")
    run(other, 500, [(0, 77.0, 1)])

    def same(values):
        return ["nan" if math.isnan(v) else v for v in values]

    expected = [4.0, 3.0, 2.5, "nan", 5.0]
    assert same(tracking._history_from_mlflow(uri, tracking.experiment_name(spec), "loss")) == expected
    monkeypatch.setattr(tracking, "_history_from_mlflow", lambda *a: pytest.fail("read through MLflow"))
    assert same(tracking.metric_history(spec, tmp_path, "loss")) == expected
    assert tracking.metric_history(spec, tmp_path, "never-logged") == []
