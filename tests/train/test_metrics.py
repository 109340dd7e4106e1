"""Training metrics azulite records itself: step time, samples/s, checkpoint duration and age, into the
job's MLflow store (SQLite, MLflow's own client reads it back) and TensorBoard event files in the job's
folder (TensorBoard's own reader opens them)."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from azulite.launch.tracking import STORE_FILE, _template, store_uri
from azulite.train import CheckpointConfig, Checkpointer, ModelState, Progress, init
from azulite.train import metrics as m


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A job folder with a ready store, and the variables the launcher gives rank 0."""
    shutil.copyfile(_template(), tmp_path / STORE_FILE)
    uri = store_uri(tmp_path)
    for k, v in {"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "fu14", "RANK": "0",
                 "AZULITE_JOB_DIR": str(tmp_path), "AZULITE_JOB_ID": "job-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(m, "_last_step", None)
    yield tmp_path
    m.flush_later()
    import mlflow

    mlflow.end_run()
    monkeypatch.setattr(m, "_run_id", None)


def _history(uri: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("fu14")
    (run,) = client.search_runs([exp.experiment_id])
    return {name: sorted((h.step, h.value) for h in client.get_metric_history(run.info.run_id, name))
            for name in run.data.metrics}


def test_step_time_and_samples_per_s_reach_mlflow_and_tensorboard(job):
    for step in (10, 20, 30):
        assert m.log_metrics({"loss": 1.0 / step}, step=step, batch_size=64)
    hist = _history(store_uri(job))
    assert [s for s, _ in hist["loss"]] == [10, 20, 30]
    # the first call has nothing to measure against; each later one covers 10 steps
    assert [s for s, _ in hist["step_time_s"]] == [20, 30]
    for (_, t), (_, rate) in zip(hist["step_time_s"], hist["samples_per_s"]):
        assert t > 0 and rate == pytest.approx(64 / t)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(job / m.TB_DIR))
    acc.Reload()
    assert {"loss", "step_time_s", "samples_per_s"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [10, 20, 30]


def test_no_batch_size_no_samples_per_s(job):
    m.log_metrics({"loss": 1.0}, step=1)
    m.log_metrics({"loss": 0.5}, step=2)
    assert "samples_per_s" not in _history(store_uri(job)) and "step_time_s" in _history(store_uri(job))


def test_checkpoint_commits_log_duration_and_age_off_the_training_thread(job, monkeypatch):
    threads = []
    real = m._write
    monkeypatch.setattr(m, "_write", lambda *a: (threads.append(threading.current_thread()), real(*a))[1])
    ctx = init({})
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    state = {"model": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1)), "progress": Progress()}
    ck = Checkpointer(CheckpointConfig(uri=str(job / "ckpt")), ctx, state)
    assert ck.save(1) and ck.save(2)
    m.flush_later()
    hist = _history(store_uri(job))
    assert [s for s, _ in hist["checkpoint_save_s"]] == [1, 2]
    assert all(v > 0 for _, v in hist["checkpoint_save_s"])
    assert [s for s, _ in hist["checkpoint_age_s"]] == [2]  # the first commit has no predecessor
    assert threads and threading.main_thread() not in threads


EXITS_WITH_A_PENDING_SAVE = """
import torch
from azulite.train import CheckpointConfig, Checkpointer, ModelState, Progress, init
ctx = init({})
model = torch.nn.Linear(4, 2)
state = {"model": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1)), "progress": Progress()}
Checkpointer(CheckpointConfig(uri=CKPT, async_save=True), ctx, state).save(7, sync=False)
"""  # no wait(), no close(): the commit happens as the interpreter exits, and its figures still land


def test_a_commit_at_interpreter_exit_still_logs_its_figures(job):
    import os
    import subprocess
    import sys

    script = f"CKPT = {str(job / 'ckpt')!r}\n" + EXITS_WITH_A_PENDING_SAVE
    p = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert (job / "ckpt" / "step-00000007" / "manifest.json").exists()
    assert [s for s, _ in _history(store_uri(job))["checkpoint_save_s"]] == [7]
