"""Sweep jobs through the local backend: trials as child jobs, the primary metric from each trial's
MLflow store, the best trial; early termination; a primary metric never logged fails the sweep after its
first trial. One of this repository's examples (examples/ddp) runs as a sweep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from azulite.launch.early_stop import should_stop
from azulite.launch.local.sweeper import read_state
from azulite.spec.sweep import Bandit, MedianStopping, Objective, TruncationSelection, load_sweep
from tests.launch.jobkit import REPO, backend, home, wait_done

_ = home
pytestmark = pytest.mark.slow

DDP_SWEEP = f"""
type: sweep
name: ddp-sweep
experiment_name: ddp-sweep
trial:
  code: {REPO / "examples" / "ddp"}
  command: >-
    python train.py --steps 6 --batch-size 16 --lr ${{{{search_space.lr}}}} --checkpoint-every 3
    --out ${{{{outputs.model}}}} --checkpoints ${{{{outputs.checkpoints}}}}
  resources: {{instance_count: 1}}
  distribution: {{type: pytorch, process_count_per_instance: 1}}
outputs:
  model: {{type: uri_folder}}
  checkpoints: {{type: uri_folder}}
sampling_algorithm: grid
search_space:
  lr: {{type: choice, values: [0.0001, 0.05]}}
objective: {{goal: minimize, primary_metric: loss}}
limits: {{max_total_trials: 5, max_concurrent_trials: 2, trial_timeout: 5m}}
"""


def az(*args):
    p = subprocess.run([str(Path(sys.executable).parent / "azulite"), *args], capture_output=True, text=True,
                       timeout=300, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    return p


def test_the_ddp_example_runs_as_a_grid_sweep_and_the_best_trial_is_the_lowest_loss(home, tmp_path):
    (tmp_path / "sweep.yaml").write_text(DDP_SWEEP)
    p = az("job", "submit", str(tmp_path / "sweep.yaml"), "--wait", "--json")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    sweep_id = json.loads(p.stdout)["id"]
    shown = json.loads(az("job", "show", sweep_id, "--json").stdout)
    state = shown["sweep"]
    assert shown["state"] == "succeeded" and [t["state"] for t in state["trials"]] == ["succeeded", "succeeded"]
    assert [t["values"]["lr"] for t in state["trials"]] == [0.0001, 0.05]  # grid order
    metrics = {t["id"]: t["metric"] for t in state["trials"]}
    assert all(isinstance(m, float) for m in metrics.values())
    assert state["best_trial"] == min(metrics, key=metrics.get)
    # each trial is an ordinary job: listed, with its own metrics
    listed = [json.loads(line)["id"] for line in az("job", "list", "--json").stdout.splitlines()]
    assert set(metrics) <= set(listed) and sweep_id in listed
    trial = json.loads(az("job", "show", state["best_trial"], "--json").stdout)
    assert trial["metrics"]["loss"]["value"] == metrics[state["best_trial"]] and trial["metrics"]["loss"]["step"] == 6
    text = az("job", "show", sweep_id).stdout
    assert "best: " + state["best_trial"] in text
    logs = az("job", "logs", sweep_id)  # printed nothing: a sweep's logs are its trials'
    assert logs.returncode == 2 and f"{sweep_id} is a sweep: its trials have the logs (" in logs.stderr
    assert all(t in logs.stderr for t in metrics)


FOREVER = """
import os, sys, time
from azulite import train
x = float(sys.argv[1])
steps = 3 if x < 1 else 10**9          # the good trial ends after 3 reports; the bad one only if stopped
for step in range(1, steps + 1):
    train.log_metrics({"err": x}, step=step)
    time.sleep(0.1)
"""


def _sweep(tmp_path: Path, metric: str, extra: str = "") -> Path:
    (tmp_path / "run.py").write_text(FOREVER)
    (tmp_path / "sweep.yaml").write_text(f"""
type: sweep
trial: {{code: ., command: "python run.py ${{{{search_space.x}}}}"}}
sampling_algorithm: grid
search_space: {{x: {{type: choice, values: [0.5, 5.0, 0.7]}}}}
objective: {{goal: minimize, primary_metric: {metric}}}
limits: {{max_total_trials: 3, max_concurrent_trials: 1, trial_timeout: 4m}}
{extra}
""")
    return tmp_path / "sweep.yaml"


def test_bandit_stops_a_trial_far_worse_than_the_best_and_the_sweep_goes_on(home, tmp_path):
    spec = load_sweep(_sweep(tmp_path, "err", "early_termination: {type: bandit, slack_factor: 0.5, evaluation_interval: 1, delay_evaluation: 2}"))
    rec = wait_done(backend().submit_sweep(spec).id, timeout=400)
    state = read_state(rec.job_dir)
    assert rec.state.value == "succeeded", rec.reason
    assert [(t["values"]["x"], t["state"]) for t in state["trials"]] == [
        (0.5, "succeeded"), (5.0, "early_terminated"), (0.7, "succeeded")]
    assert state["best_trial"] == state["trials"][0]["id"]
    p = az("job", "preempt", rec.id)  # accepted before, and nothing happened to the trials
    assert p.returncode == 2 and f"{rec.id} is a sweep: its trials are the jobs that run" in p.stderr, p.stderr
    stopped = backend().status(state["trials"][1]["id"])  # its own record says why ("canceled by user" before)
    assert stopped.reason.startswith(f"stopped early by sweep {rec.id}'s bandit policy after"), stopped.reason


def test_trials_stopped_by_the_sweeps_timeout_keep_what_they_reported(home, tmp_path):
    """limits.timeout cancels the running trials; the loss they had logged was dropped and the sweep failed
    with "no trial reported 'err'". (The trial logs from its first second; 30 s leaves a loaded machine
    room to start it.)"""
    _sweep(tmp_path, "err")
    spec = load_sweep(_one_trial_timed_out(tmp_path))
    rec = wait_done(backend().submit_sweep(spec).id, timeout=400)
    state = read_state(rec.job_dir)
    assert rec.state.value == "succeeded" and "best" in rec.reason, rec.reason
    (trial,) = state["trials"]
    assert trial["state"] == "canceled" and trial["metric"] == 5.0 and state["best_trial"] == trial["id"]
    assert "the sweep's timeout (30s) passed" in backend().status(trial["id"]).reason


def _one_trial_timed_out(tmp_path: Path) -> Path:
    """_sweep's file with one trial that would run forever, and a sweep timeout."""
    text = (tmp_path / "sweep.yaml").read_text()
    text = text.replace("values: [0.5, 5.0, 0.7]", "values: [5.0]").replace(
        "trial_timeout: 4m", "trial_timeout: 4m, timeout: 30s")
    (tmp_path / "sweep.yaml").write_text(text)
    return tmp_path / "sweep.yaml"


def test_a_sweep_whose_driver_dies_cancels_its_running_trials(home, tmp_path):
    """kill -9 of a sweep's driver: the sweep failed for good and its trials ran on unwatched, `job show`
    listing them as running from the driver's last write."""
    import signal

    from tests.launch.jobkit import wait_for

    _sweep(tmp_path, "err")
    b = backend()
    sweep = b.submit_sweep(load_sweep(_forever(tmp_path))).id
    wait_for(lambda: (read_state(b.status(sweep).job_dir) or {}).get("trials"), 120, "the first trial")
    trial = read_state(b.status(sweep).job_dir)["trials"][0]["id"]
    wait_for(lambda: b.status(trial).state.value == "running", 120, "the trial to run")
    os.kill(b.status(sweep).supervisor_pid, signal.SIGKILL)
    wait_for(lambda: b.status(sweep).state.terminal, 120, "the sweep's recovery")  # a look notices the death
    rec = b.status(sweep)
    assert rec.state.value == "failed" and f"its running trial(s) {trial} canceled" in rec.reason, rec.reason
    ended = wait_done(trial, timeout=120)
    assert ended.state.value == "canceled" and f"sweep {sweep}'s driver died" in ended.reason, ended.reason
    assert read_state(rec.job_dir)["trials"][0]["state"] == "canceling"


def _forever(tmp_path: Path) -> Path:
    """_sweep's file with one trial that runs until it is stopped, and no sweep timeout."""
    text = (tmp_path / "sweep.yaml").read_text().replace("values: [0.5, 5.0, 0.7]", "values: [5.0]")
    (tmp_path / "sweep.yaml").write_text(text)
    return tmp_path / "sweep.yaml"


def test_a_primary_metric_no_trial_logs_fails_the_sweep_after_the_first_trial(home, tmp_path):
    spec = load_sweep(_sweep(tmp_path, "accuracy"))
    rec = wait_done(backend().submit_sweep(spec).id, timeout=300)
    assert rec.state.value == "failed" and "without logging the primary metric 'accuracy'" in rec.reason
    assert len(read_state(rec.job_dir)["trials"]) == 1  # no trial started after the first one ended


def test_policies_in_isolation():
    mini = Objective(goal="minimize", primary_metric="m")
    reports = {"a": [1.0, 1.0, 1.0], "b": [1.0, 1.0, 1.6]}
    assert should_stop(Bandit(type="bandit", slack_factor=0.5), mini, "b", reports)
    assert not should_stop(Bandit(type="bandit", slack_factor=0.7), mini, "b", reports)
    assert not should_stop(Bandit(type="bandit", slack_amount=0.5, delay_evaluation=3), mini, "b", reports)
    assert should_stop(MedianStopping(type="median_stopping"), mini, "b", {**reports, "c": [0.9, 0.9, 0.9]})
    maxi = Objective(goal="maximize", primary_metric="m")
    assert should_stop(TruncationSelection(type="truncation_selection", truncation_percentage=50), maxi, "b",
                       {"a": [3.0], "b": [1.0], "c": [2.0], "d": [4.0]})
    assert not should_stop(TruncationSelection(type="truncation_selection", truncation_percentage=50), maxi, "a",
                           {"a": [3.0], "b": [1.0], "c": [2.0], "d": [4.0]})


SILENT = "import time\ntime.sleep(600)\n"  # reports nothing, ends only when stopped


def _silent_sweep(tmp_path: Path, limits: str) -> Path:
    (tmp_path / "run.py").write_text(SILENT)
    (tmp_path / "sweep.yaml").write_text(f"""
type: sweep
trial: {{code: ., command: "python run.py ${{{{search_space.x}}}}"}}
sampling_algorithm: grid
search_space: {{x: {{type: choice, values: [1]}}}}
objective: {{goal: minimize, primary_metric: err}}
limits: {{max_total_trials: 1, max_concurrent_trials: 1, {limits}}}
""")
    return tmp_path / "sweep.yaml"


def test_a_sweep_stopped_by_its_timeout_says_so_as_a_timed_out_job_does(home, tmp_path):
    """It said "failed ... exit code 1: no trial reported 'err'", as if the trials had been at fault."""
    rec = wait_done(backend().submit_sweep(load_sweep(_silent_sweep(tmp_path, "timeout: 2s"))).id, timeout=300)
    assert (rec.state.value, rec.exit_code) == ("failed", 124), rec.reason  # a command job's timeout: 124
    assert rec.reason == "timed out after 2s (limits.timeout) before any trial reported 'err'"
    p = az("job", "wait", rec.id)
    assert p.returncode == 124, p.stdout + p.stderr


def test_a_trial_stopped_by_the_trial_timeout_names_it(home, tmp_path):
    rec = wait_done(backend().submit_sweep(load_sweep(_silent_sweep(tmp_path, "trial_timeout: 2s"))).id, timeout=300)
    (trial,) = read_state(rec.job_dir)["trials"]
    ended = backend().status(trial["id"])
    assert (ended.state.value, ended.exit_code) == ("failed", 124)
    assert ended.reason == f"timed out after 2s (limits.trial_timeout of sweep {rec.id})"  # was "(spec timeout)"
    assert (rec.state.value, rec.exit_code, rec.reason) == ("failed", 1, "no trial reported 'err'")


def test_a_canceled_sweep_records_no_exit_code_as_a_canceled_job(home, tmp_path):
    from tests.launch.jobkit import wait_for

    b = backend()
    sweep = b.submit_sweep(load_sweep(_silent_sweep(tmp_path, "trial_timeout: 4m"))).id
    wait_for(lambda: (read_state(b.status(sweep).job_dir) or {}).get("trials"), 120, "the first trial")
    b.cancel(sweep)
    rec = wait_done(sweep, timeout=120)
    assert (rec.state.value, rec.exit_code) == ("canceled", None), rec  # it recorded 1
    assert az("job", "wait", sweep).returncode == 130
