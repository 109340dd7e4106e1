"""Job series from the real job store: a running job of the local backend with checkpoints on disk, read
beside a writer holding the store; a corrupt store keeps the exporter up and says so."""

from __future__ import annotations

import math
import sqlite3
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from azulite.launch.backend import get_backend
from azulite.launch.records import JobState
from azulite.launch.settings import Settings
from azulite.observe.jobs import JobCollector
from azulite.observe.telemetry import registry_for
from azulite.spec.loader import load_job
from tests.launch.jobkit import home, spec_2x1, wait_for, write_job

_ = home

# Commits two checkpoints in the documented layout (manifest.json written last), 30 s apart by their
# manifests, logs a line, then waits to be canceled.
CHECKPOINTING = """
import json, os, time
from datetime import datetime, timezone
root = os.environ["AZULITE_OUTPUT_CHECKPOINTS"]
now = time.time()
for step, age in ((10, 60), (20, 30)):
    d = os.path.join(root, f"step-{step:08d}")
    os.makedirs(d, exist_ok=True)
    made = datetime.fromtimestamp(now - age, timezone.utc).isoformat(timespec="seconds")
    json.dump({"format": "azulite.checkpoint/1", "step": step, "files": {}, "created_at": made},
              open(os.path.join(d, "manifest.json"), "w"))
os.makedirs(os.path.join(root, "step-00000030"), exist_ok=True)  # an interrupted save: not counted
print("step 19 loss 0.25 step_s 0.1", flush=True)
print("step 20 loss nan step_s 0.1", flush=True)  # diverged: exported as NaN for the loss rule
time.sleep(300)
"""


def scrape(collector) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry_for(collector)).decode())}


def one(fams, name, **labels) -> float:
    (s,) = [s for s in fams[name].samples if all(s.labels.get(k) == v for k, v in labels.items())]
    return s.value


def test_running_job_progress_checkpoints_and_a_busy_store(home, tmp_path):
    spec = write_job(tmp_path / "job", CHECKPOINTING, spec_2x1(nodes=1, per_node=1, extra="outputs: {checkpoints: {type: uri_folder}}"))
    b = get_backend("local", Settings.from_environ())
    rec = b.submit(load_job(spec))
    collector = JobCollector(Settings.from_environ().db_path)

    def ready():
        fams = scrape(collector)
        running = [s for s in fams["azulite_job_state"].samples if s.labels["state"] == "running"]
        has = running and fams["azulite_job_last_progress_timestamp_seconds"].samples and \
            fams["azulite_job_checkpoint_last_step"].samples and fams["azulite_job_train_step"].samples and \
            fams["azulite_job_train_step"].samples[0].value == 20
        return fams if has else None

    fams = wait_for(ready, 180, "the job running with checkpoints")
    assert one(fams, "azulite_job_store_up") == 1
    assert one(fams, "azulite_job_state", job_id=rec.id, state="running") == 1
    assert one(fams, "azulite_job_checkpoint_last_step", job_id=rec.id) == 20
    assert one(fams, "azulite_job_checkpoint_interval_seconds", job_id=rec.id) == 30
    assert abs(one(fams, "azulite_job_checkpoint_last_timestamp_seconds", job_id=rec.id) - (time.time() - 30)) < 120
    assert one(fams, "azulite_job_checkpoints_readable", job_id=rec.id) == 1
    assert time.time() - one(fams, "azulite_job_last_progress_timestamp_seconds", job_id=rec.id) < 300
    assert one(fams, "azulite_job_rank_restarts", job_id=rec.id, rank="0") == 0
    assert one(fams, "azulite_job_train_step", job_id=rec.id) == 20
    assert math.isnan(one(fams, "azulite_job_train_loss", job_id=rec.id))

    # a writer in the middle of a transaction: the reader still reads (WAL), and never takes a write lock
    writer = sqlite3.connect(Settings.from_environ().db_path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        assert one(scrape(collector), "azulite_job_store_up") == 1
    finally:
        writer.execute("ROLLBACK")
        writer.close()

    b.cancel(rec.id)
    wait_for(lambda: b.status(rec.id).state == JobState.CANCELED, 60, "the cancel")
    fams = scrape(collector)
    assert one(fams, "azulite_job_state", job_id=rec.id, state="canceled") == 1
    assert not [s for s in fams["azulite_job_checkpoint_last_step"].samples if s.labels["job_id"] == rec.id]


def test_missing_or_corrupt_store_is_said_not_raised(tmp_path):
    missing = JobCollector(tmp_path / "nope" / "jobs.db")
    assert one(scrape(missing), "azulite_job_store_up") == 0
    assert not (tmp_path / "nope").exists(), "the exporter never creates the store"
    bad = tmp_path / "jobs.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    fams = scrape(JobCollector(bad))
    assert one(fams, "azulite_job_store_up") == 0 and "azulite_job_state" not in fams


def test_changes_since_a_cursor_are_only_the_jobs_that_changed(tmp_path):
    from azulite.launch.local.store import JobStore
    from azulite.observe.jobs import ReadOnlyJobStore

    store = JobStore(tmp_path / "jobs.db")
    ids = [store.create(name=f"j{i}", backend="local", spec={}, spec_path=None, environment=None,
                        jobs_dir=tmp_path / "jobs").id for i in range(4)]
    ro = ReadOnlyJobStore(tmp_path / "jobs.db")
    cursor, jobs, full = ro.changes(None, 100)
    assert full and [j.id for j in jobs] == ids[::-1]
    assert ro.changes(cursor, 100) == (cursor, [], False)  # nothing changed: nothing sent
    store.transition(ids[1], JobState.CANCELED, message="x")
    new = store.create(name="late", backend="local", spec={}, spec_path=None, environment=None, jobs_dir=tmp_path / "jobs")
    cursor2, jobs, full = ro.changes(cursor, 100)
    assert not full and cursor2 > cursor
    assert {j.id: j.state for j in jobs} == {ids[1]: JobState.CANCELED, new.id: JobState.QUEUED}
    _, jobs, full = ro.changes(cursor2 + 1000, 100)  # a cursor this store never gave (replaced): all again
    assert full and len(jobs) == 5
