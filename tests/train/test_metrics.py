"""Training metrics azulite records itself: step time, samples/s, checkpoint save time and age, into the
job's MLflow store (MLflow's own client reads them back) and TensorBoard event files in the job's folder
(TensorBoard's own reader opens them); a preempted rank's figures reach the store before it exits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest

from azulite.launch.tracking import STORE_FILE, _template, store_uri
from azulite.train import metric_writer as mw
from azulite.train import metrics as m
from tests.launch.jobkit import wait_for


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A job folder with a ready store, and the variables the launcher gives rank 0."""
    shutil.copyfile(_template(), tmp_path / STORE_FILE)
    for k, v in {"MLFLOW_TRACKING_URI": store_uri(tmp_path), "MLFLOW_EXPERIMENT_NAME": "fu14", "RANK": "0",
                 "AZULITE_JOB_DIR": str(tmp_path), "AZULITE_JOB_ID": "job-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(m, "_last_step", None)
    monkeypatch.setattr(m, "_last_commit", None)
    yield tmp_path
    mw.close()


def history(job_dir) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store_uri(job_dir))
    (run,) = client.search_runs([client.get_experiment_by_name("fu14").experiment_id])
    return {name: sorted((h.step, h.value) for h in client.get_metric_history(run.info.run_id, name))
            for name in run.data.metrics}


def tensorboard_scalars(job_dir) -> dict[str, list[int]]:
    # the reader would import TensorFlow (installed here) without TensorBoard's own no-TF switch
    sys.modules.setdefault("tensorboard.compat.notf", type(sys)("tensorboard.compat.notf"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(job_dir / mw.TB_DIR))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_step_time_and_samples_per_s_reach_mlflow_and_tensorboard(job):
    for step in (10, 20, 30):
        assert m.log_metrics({"loss": 1.0 / step}, step=step, batch_size=64)
    assert m.flush()
    hist = history(job)
    assert [s for s, _ in hist["loss"]] == [10, 20, 30]
    # the first call has nothing to measure against; each later one covers 10 steps
    assert [s for s, _ in hist["step_time_s"]] == [20, 30]
    for (_, t), (_, rate) in zip(hist["step_time_s"], hist["samples_per_s"]):
        assert t > 0 and rate == pytest.approx(64 / t)
    tb = tensorboard_scalars(job)
    assert tb["loss"] == [10, 20, 30] and tb["samples_per_s"] == [20, 30]


def test_a_scripts_own_figures_win_and_no_batch_size_means_no_samples_per_s(job):
    m.log_metrics({"loss": 1.0}, step=1)
    m.log_metrics({"loss": 0.5, "step_time_s": 7.0}, step=2)
    m.log_metrics({"loss": 0.4}, step=3)
    m.flush()
    hist = history(job)
    assert "samples_per_s" not in hist
    assert hist["step_time_s"][0] == (2, 7.0) and hist["step_time_s"][1][0] == 3


def test_only_the_writer_thread_writes_and_a_slow_store_never_holds_the_caller(job, monkeypatch):
    gate, writers = threading.Event(), []
    real = mw.MetricWriter._mlflow

    def slow(self, batch):
        writers.append(threading.current_thread().name)
        assert gate.wait(120), "the test never opened the gate"
        return real(self, batch)

    monkeypatch.setattr(mw.MetricWriter, "_mlflow", slow)
    # the store is stuck: every call still returns (a blocking call would never get past this loop)
    for step in range(1, 6):
        assert m.log_metrics({"loss": 1.0 / step}, step=step)
    assert m.checkpoint_committed(5, 0.25)
    gate.set()
    assert m.flush(120)
    assert set(writers) == {"azulite-metrics"}
    hist = history(job)
    assert [s for s, _ in hist["loss"]] == [1, 2, 3, 4, 5] and hist["checkpoint_save_s"] == [(5, 0.25)]


def test_init_starts_rank_0s_writer_connecting_without_waiting_and_early_values_keep_their_order(job, monkeypatch):
    from azulite import train

    # a connect that ends only when the test says, and a warm-up wait no test outlives: an init that
    # waited for the writer would never return while the connect is held
    monkeypatch.setattr(m, "WARM_UP_WAIT_S", 3600.0)
    connecting, release = threading.Event(), threading.Event()
    real = mw.MetricWriter._connect

    def held(self):
        connecting.set()
        assert release.wait(120), "the test never released the connect"
        return real(self)

    monkeypatch.setattr(mw.MetricWriter, "_connect", held)
    done = threading.Event()
    threading.Thread(target=lambda: (train.init(), done.set()), daemon=True).start()
    try:
        assert done.wait(120), "train.init() waited for the metrics writer to connect"
        assert connecting.wait(120), "train.init() did not start rank 0's writer"
        writer = mw.current()
        assert writer is not None and writer._client is None  # still connecting: training goes on
        for step in (1, 2, 3):  # the first steps' values queue behind the connect
            assert m.log_metrics({"loss": 1.0 / step}, step=step)
        assert writer.written == 0
    finally:
        release.set()
    assert m.flush(120)
    hist = history(job)
    assert hist["loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert tensorboard_scalars(job)["loss"] == [1, 2, 3]


def test_values_within_the_write_interval_go_to_the_store_in_one_transaction(job, monkeypatch):
    # an interval no test outlives: only the flush can make the writer write
    monkeypatch.setenv("AZULITE_METRICS_WRITE_INTERVAL_S", "3600")
    batches = []
    real = mw.MetricWriter._mlflow

    def counted(self, batch):
        batches.append([step for _, step, _ in batch])
        return real(self, batch)

    monkeypatch.setattr(mw.MetricWriter, "_mlflow", counted)
    m.warm_up()  # the writer is connected and waiting for values
    assert m.log_metrics({"loss": 1.0}, step=1)
    writer = mw.current()
    wait_for(lambda: writer._q.qsize() == 0, 120, "the writer to take the first value")
    for step in range(2, 6):
        assert m.log_metrics({"loss": 1.0 / step}, step=step)
    assert m.checkpoint_committed(5, 0.25)
    assert writer.written == 0 and batches == []  # held back, not lost: the flush writes them
    assert m.flush(120)
    assert batches == [[1, 2, 3, 4, 5, 5]]
    hist = history(job)
    assert [s for s, _ in hist["loss"]] == [1, 2, 3, 4, 5] and hist["checkpoint_save_s"] == [(5, 0.25)]
    assert tensorboard_scalars(job)["loss"] == [1, 2, 3, 4, 5]


def test_a_failing_store_is_counted_said_once_and_never_raises(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("a file, not a folder")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/file/m.db")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("AZULITE_JOB_DIR", raising=False)
    try:
        for step in range(1, 4):
            assert m.log_metrics({"loss": 1.0}, step=step)
        assert m.flush(120)
        w = mw.current()
        assert w.failed >= 3 and w.written == 0
        said = [r for r in caplog.records if r.name == "azulite.train.metrics" and "could not write metrics" in r.message]
        assert len(said) == 1, [r.message for r in caplog.records]
    finally:
        mw.close()


# Rank 0 of a one-rank job: logs, checkpoints every 2 steps, and is sent SIGTERM at step 5 by itself (as
# torchrun forwards it): it must agree to stop, commit step 5 and exit 75 with every figure in the store.
PREEMPTED = """
import os, signal, sys
import torch
from azulite import train
ctx = train.init({})
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
progress = train.Progress()
ck = train.Checkpointer(train.CheckpointConfig(uri=CKPT, interval=2), ctx,
                        {"model": train.ModelState(model, opt), "progress": progress})
stop = train.Preemption(ctx).install()
while True:
    progress.step += 1
    train.log_metrics({"loss": 1.0 / progress.step}, step=progress.step, batch_size=8)
    if progress.step == 5:
        os.kill(os.getpid(), signal.SIGTERM)
    if stop.should_stop():
        ck.save(progress.step, sync=True, raise_on_error=True)
        stop.exit()
    ck.maybe_save(progress.step)
"""


def test_a_preempted_rank_exits_75_with_its_figures_in_the_store_and_tensorboard(job):
    script = f"CKPT = {str(job / 'ckpt')!r}\n" + PREEMPTED
    p = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert p.returncode == 75, p.stderr
    assert "tensorflow" not in p.stderr.lower(), p.stderr  # TensorBoard files without importing TensorFlow
    hist = history(job)
    assert [s for s, _ in hist["loss"]] == [1, 2, 3, 4, 5]
    assert [s for s, _ in hist["checkpoint_save_s"]] == [2, 4, 5]  # the preemption's save included
    assert [s for s, _ in hist["checkpoint_age_s"]] == [4, 5] and all(v > 0 for _, v in hist["checkpoint_age_s"])
    assert [s for s, _ in hist["samples_per_s"]] == [2, 3, 4, 5]
    assert tensorboard_scalars(job)["checkpoint_save_s"] == [2, 4, 5]
    from mlflow.tracking import MlflowClient

    (run,) = MlflowClient(tracking_uri=store_uri(job)).search_runs(
        [MlflowClient(tracking_uri=store_uri(job)).get_experiment_by_name("fu14").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["azulite.job_id"] == "job-1"


# The writer is stuck in the store for good: the process still exits, after the bounded wait, saying so.
STUCK = """
import threading
from azulite.train import metric_writer as mw, metrics
mw.CLOSE_TIMEOUT_S = 0.5
stuck = threading.Event()
mw.MetricWriter._mlflow = lambda self, batch: stuck.wait()
metrics.log_metrics({"loss": 1.0}, step=1)
print("logged", flush=True)
"""


def test_exit_is_bounded_when_the_store_hangs(job):
    p = subprocess.run([sys.executable, "-c", STUCK], env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "logged" in p.stdout, p.stderr
    assert "did not take the last values" in p.stderr


# The writer is still connecting (importing MLflow, creating the run: seconds on a busy node) when a
# script that logged its one metric at its last step exits: the exit waits for it, well past the stall
# bound, and the value reaches the store.
SLOW_CONNECT = """
import threading
from azulite.train import metric_writer as mw, metrics
# a stall bound the store's own writes (the first log_batch, ending the run) stay well inside on a loaded
# machine (with 0.2 s, at load 8 the first write after the connect was once taken for a stuck store)
mw.CLOSE_TIMEOUT_S = 2.0
real = mw.MetricWriter._connect
logged = threading.Event()
def slow(self):
    logged.wait()  # not connected before the value is queued and the exit has begun
    threading.Event().wait(6.0)  # three stall bounds: the old exit gave up here
    return real(self)
mw.MetricWriter._connect = slow
metrics.log_metrics({"objective": 0.25}, step=7)
logged.set()
print("logged", flush=True)
"""


def test_exit_waits_for_a_writer_still_connecting_and_the_last_metric_is_kept(job):
    p = subprocess.run([sys.executable, "-c", SLOW_CONNECT], env=dict(os.environ), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and "logged" in p.stdout, p.stderr
    assert "did not take the last values" not in p.stderr, p.stderr
    assert history(job)["objective"] == [(7, 0.25)]


def test_first_use_lock_lies_beside_a_sqlite_store_not_in_the_temporary_folder(tmp_path, monkeypatch):
    """Every store once left an empty azulite-mlflow-<hash>.lock in /tmp, never removed (138 after a day of
    tests); beside the store it goes with the job's folder. A store elsewhere keeps the temporary folder."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(mw.tempfile, "tempdir", str(tmp))
    store = tmp_path / "job" / STORE_FILE
    store.parent.mkdir()
    with mw.first_use_lock(f"sqlite:///{store}"):
        assert (store.parent / (STORE_FILE + ".lock")).exists()
    assert list(tmp.iterdir()) == []
    with mw.first_use_lock("http://127.0.0.1:5000"):  # a tracking server: the temporary folder
        assert [p.name for p in tmp.iterdir()] == [p.name for p in tmp.glob("azulite-mlflow-*.lock")] != []
    with mw.first_use_lock(f"sqlite:///{tmp_path / 'gone' / STORE_FILE}"):  # a folder that cannot hold it
        assert len(list(tmp.glob("azulite-mlflow-*.lock"))) == 2
