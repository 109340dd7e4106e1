"""The job store: real SQLite (WAL), the state machine, ids under concurrent submits from processes."""

import multiprocessing as mp
import os
import sqlite3

import pytest

from azulite.launch.local.store import JobStore
from azulite.launch.records import JobState, TRANSITIONS
from tests.test_sqlite_wal import opened_at_once


def _create_many(db: str, n: int, q) -> None:
    s = JobStore(db)
    q.put([s.create(name="same", backend="local", spec={}, spec_path=None, environment=None, jobs_dir="/tmp/x").id
           for _ in range(n)])


def test_a_fresh_store_opened_by_several_processes_at_once_opens_for_all(tmp_path):
    """Two shells submitting into a new AZULITE_HOME: SQLite refused the switch to WAL of a fresh file with
    "database is locked" at once (no busy wait) in 10 of 100 rounds of 6 openers before the store retried it
    (a CI run of `test_two_shells_submitting_at_once` hit it). A few rounds here; 500 in `make soak`."""
    opened_at_once(tmp_path, JobStore, 20)


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_a_fresh_store_opened_at_once_soak(tmp_path):
    opened_at_once(tmp_path, JobStore, 500 if os.environ.get("AZULITE_SOAK") == "1" else 20)


def test_wal_and_ids(tmp_path):
    s = JobStore(tmp_path / "jobs.db")
    a = s.create(name="ddp", backend="local", spec={"a": 1}, spec_path="x.yaml", environment="img:1", jobs_dir=tmp_path)
    b = s.create(name="ddp", backend="local", spec={}, spec_path=None, environment=None, jobs_dir=tmp_path)
    c = s.create(name="other", backend="local", spec={}, spec_path=None, environment=None, jobs_dir=tmp_path)
    assert (a.id, b.id, c.id) == ("ddp-1", "ddp-2", "other-1")
    assert a.state == JobState.QUEUED and a.spec == {"a": 1} and a.environment == "img:1"
    mode = sqlite3.connect(tmp_path / "jobs.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_state_machine_refuses_illegal_transitions(tmp_path):
    s = JobStore(tmp_path / "jobs.db")
    j = s.create(name="j", backend="local", spec={}, spec_path=None, environment=None, jobs_dir=tmp_path).id
    assert not s.transition(j, JobState.SUCCEEDED)  # queued -> succeeded skips running
    assert s.transition(j, JobState.RUNNING, attempt=1)
    assert s.transition(j, JobState.PREEMPTED, exit_code=75)
    assert s.transition(j, JobState.REQUEUED)
    assert s.transition(j, JobState.RUNNING, attempt=2)
    assert s.transition(j, JobState.SUCCEEDED, exit_code=0)
    assert not s.transition(j, JobState.CANCELED)  # terminal stays terminal
    rec = s.get(j)
    assert rec.state == JobState.SUCCEEDED and rec.attempt == 2 and rec.exit_code == 0
    assert [(a.attempt, a.state) for a in rec.attempts] == [(1, "requeued"), (2, "succeeded")]
    assert [e["state"] for e in rec.events] == ["queued", "running", "preempted", "requeued", "running", "succeeded"]
    assert all(not TRANSITIONS[t] for t in JobState if t.terminal)


def test_concurrent_submits_from_processes_get_distinct_ids(tmp_path):
    db = str(tmp_path / "jobs.db")
    JobStore(db)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_create_many, args=(db, 10, q)) for _ in range(4)]
    for p in procs:
        p.start()
    ids = [i for _ in procs for i in q.get(timeout=120)]
    for p in procs:
        p.join(60)
    assert sorted(ids, key=lambda i: int(i.split("-")[1])) == [f"same-{n}" for n in range(1, 41)]
    assert len(JobStore(db).list(100)) == 40


def test_preempt_is_flagged_only_on_a_running_job(tmp_path):
    s = JobStore(tmp_path / "jobs.db")
    j = s.create(name="j", backend="local", spec={}, spec_path=None, environment=None, jobs_dir=tmp_path).id
    assert not s.request_preempt(j) and s.flags(j) == (False, False)  # queued: nothing to preempt
    s.transition(j, JobState.RUNNING, attempt=1)
    assert s.request_preempt(j) and s.flags(j) == (False, True)
    s.transition(j, JobState.PREEMPTED, exit_code=75)
    s.transition(j, JobState.REQUEUED)
    assert not s.request_preempt(j)  # between attempts: refused, not silently dropped by the next start
    s.transition(j, JobState.RUNNING, attempt=2)
    assert s.flags(j) == (False, False)
    assert not s.request_preempt("nope-1")


def test_a_store_of_an_older_azulite_gets_the_columns_added_since(tmp_path):
    """A store from before preempt_requested and restarts: `job show` was an IndexError's traceback and a
    submit failed in its supervisor ("no such column")."""
    s = JobStore(tmp_path / "jobs.db")
    job = s.create(name="old", backend="local", spec={}, spec_path=None, environment=None, jobs_dir=tmp_path)
    db = sqlite3.connect(tmp_path / "jobs.db")
    db.executescript("ALTER TABLE processes DROP COLUMN restarts; ALTER TABLE jobs DROP COLUMN preempt_requested;"
                     "PRAGMA user_version = 0;")
    db.close()
    s = JobStore(tmp_path / "jobs.db")
    assert s.get(job.id).name == "old" and [j.id for j in s.list()] == [job.id]
    assert s.flags(job.id) == (False, False)  # preempt_requested is back: no OperationalError
    db = sqlite3.connect(tmp_path / "jobs.db")
    assert db.execute("PRAGMA user_version").fetchone()[0] >= 1
    assert "restarts" in {r[1] for r in db.execute("PRAGMA table_info(processes)")}
    db.close()


def test_a_store_of_a_newer_azulite_is_refused_with_that_said(tmp_path):
    from azulite.errors import StorageError

    s = JobStore(tmp_path / "jobs.db")
    job = s.create(name="new", backend="local", spec={}, spec_path=None, environment=None, jobs_dir=tmp_path)
    db = sqlite3.connect(tmp_path / "jobs.db")
    db.execute("UPDATE jobs SET state = 'paused' WHERE id = ?", (job.id,))  # a state this azulite does not know
    db.commit()
    with pytest.raises(StorageError, match=f"job {job.id} is in state 'paused', which this azulite does not know"):
        s.list()  # was ValueError's traceback: no job could be listed
    db.execute("PRAGMA user_version = 99")
    db.commit()
    db.close()
    with pytest.raises(StorageError, match="written by a newer azulite"):
        JobStore(tmp_path / "jobs.db")
