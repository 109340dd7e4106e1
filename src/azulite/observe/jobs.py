"""Training jobs as Prometheus series (``azulite observe --jobs``), read from the local job store and the
jobs' checkpoint locations: what the training alert rules watch (no progress, a stale checkpoint, a rank
restarting again and again).

Jobs are labelled ``job_id``, not ``job``: Prometheus gives every scraped series its scrape job's name in
``job``, and a clash would rename ours to ``exported_job``.

The store is opened read-only (``mode=ro``; SQLite WAL lets readers run beside the launcher's writer):
this exporter never creates, migrates or locks it. A store that is missing, busy past the timeout or
corrupt makes ``azulite_job_store_up`` 0 and the job series absent for that scrape; the exporter keeps
serving.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from azulite.contract import CHECKPOINT_OUTPUT
from azulite.errors import AzuliteError
from azulite.launch.local.store import JobStore
from azulite.launch.records import JobRecord, JobState
from azulite.spec.job import Output
from azulite.train.catalog import read_manifest
from azulite.train.storage import CheckpointStorage, StorageSettings

#: jobs exported per scrape (newest first): a store of years of jobs must not make a scrape slow
MAX_JOBS = 200
#: the progress line azulite's training examples print on rank 0 (``step N loss X step_s T ...``)
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)(?: step_s (\S+))?", re.M)
_TAIL_BYTES = 64 << 10


class ReadOnlyJobStore(JobStore):
    """The launcher's store, read through a read-only connection: no schema creation, no WAL switch."""

    def __init__(self, db_path: Path, timeout_s: float = 5.0) -> None:  # noqa: D107 — no super(): it writes
        self.db_path = Path(db_path)
        self.timeout_s = timeout_s

    def _connect(self) -> sqlite3.Connection:
        if not self.db_path.exists():
            raise sqlite3.OperationalError(f"no job store at {self.db_path}")
        conn = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=self.timeout_s, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout={int(self.timeout_s * 1000)}")
        return conn

    def changes(self, since: int | None, limit: int) -> tuple[int, list[JobRecord], bool]:
        """(cursor, jobs, full): with ``since`` None (or a cursor this store never gave: it was replaced)
        the newest ``limit`` jobs and ``full``; else only the jobs changed after ``since``. The cursor is
        the newest row of the store's events table: every submit and state change writes one, and rows are
        never deleted, so a job whose listed fields changed has an event past any earlier cursor. One read
        snapshot: a change between the two queries is never lost."""
        with self._read() as db:
            db.execute("BEGIN")  # WAL: one consistent snapshot for the cursor and the rows
            try:
                cursor = db.execute("SELECT COALESCE(MAX(rowid), 0) FROM events").fetchone()[0]
                if since is None or since > cursor:
                    rows = db.execute("SELECT * FROM jobs ORDER BY created_at DESC, rowid DESC LIMIT ?", (limit,)).fetchall()
                    return cursor, [self._job(r) for r in rows], True
                rows = db.execute("SELECT * FROM jobs WHERE id IN (SELECT job_id FROM events WHERE rowid > ?) "
                                  "ORDER BY created_at DESC, rowid DESC LIMIT ?", (since, limit)).fetchall()
                return cursor, [self._job(r) for r in rows], False
            finally:
                db.execute("COMMIT")


def last_progress(rec: JobRecord) -> float | None:
    """When any rank of the current attempt last wrote to its log (a training loop that logs is moving)."""
    times = []
    for p in rec.processes:
        if p.kind == "rank" and p.attempt == rec.attempt and p.log:
            try:
                times.append(os.stat(p.log).st_mtime)
            except OSError:
                pass
    return max(times) if times else None


def last_loss(rec: JobRecord) -> tuple[int, float] | None:
    """(step, loss) of the last progress line in rank 0's log of the current attempt (read from its tail:
    a scrape never reads a whole log). ``nan``/``inf`` losses come through as such: that is what the
    loss-not-finite rule looks for."""
    logs = [p.log for p in rec.processes if p.kind == "rank" and p.rank == 0 and p.attempt == rec.attempt and p.log]
    if not logs:
        return None
    try:
        with open(logs[0], "rb") as f:
            f.seek(max(0, os.path.getsize(logs[0]) - _TAIL_BYTES))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    for m in reversed(list(STEP_LINE.finditer(tail))):
        try:
            return int(m.group(1)), float(m.group(2))
        except ValueError:
            continue  # a torn or corrupt line: the one before it
    return None


def checkpoint_times(rec: JobRecord, environ: Mapping[str, str]) -> tuple[int, float, float | None] | None:
    """(last committed step, its commit time, seconds between the last two commits) of the job's
    ``outputs.checkpoints``; None when it has none yet. Raises AzuliteError when storage cannot be read."""
    raw = (rec.spec.get("outputs") or {}).get(CHECKPOINT_OUTPUT)
    if raw is None:
        return None
    location = Output.model_validate(raw).location(rec.job_dir, CHECKPOINT_OUTPUT)
    env = {**environ, **rec.spec.get("environment_variables", {})}
    storage = CheckpointStorage(location, StorageSettings.from_environ(env))
    if not storage.remote and not Path(storage.path()).is_dir():
        return None
    from azulite.train.catalog import scan_steps

    committed: list[tuple[int, float]] = []
    for step, rel in reversed(scan_steps(storage)):  # newest first; two commits are enough
        manifest = read_manifest(storage, rel, step)
        if manifest is not None:
            committed.append((step, datetime.fromisoformat(manifest["created_at"]).timestamp()))
            if len(committed) == 2:
                break
    if not committed:
        return None
    interval = committed[0][1] - committed[1][1] if len(committed) == 2 else None
    return committed[0][0], committed[0][1], interval


class JobCollector(Collector):
    def __init__(self, db_path: Path, environ: Mapping[str, str] | None = None) -> None:
        self.store = ReadOnlyJobStore(db_path)
        self.environ = dict(os.environ if environ is None else environ)

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("azulite_job_store_up", "1 when the job store could be read at this scrape.")
        try:
            recs = [self.store.get(r.id) for r in self.store.list(MAX_JOBS)]
        except (sqlite3.Error, AzuliteError, ValueError, KeyError):
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        state = GaugeMetricFamily("azulite_job_state", "1 for the job's current state.", labels=["job_id", "name", "state"])
        attempts = GaugeMetricFamily("azulite_job_attempt", "The job's current attempt (1 = first).", labels=["job_id"])
        restarts = CounterMetricFamily("azulite_job_rank_restarts", "Elastic restarts of each rank, all attempts.", labels=["job_id", "rank"])
        progress = GaugeMetricFamily("azulite_job_last_progress_timestamp_seconds",
                                     "When a rank of the running attempt last wrote to its log.", labels=["job_id"])
        ck_step = GaugeMetricFamily("azulite_job_checkpoint_last_step", "Step of the last committed checkpoint.", labels=["job_id"])
        ck_time = GaugeMetricFamily("azulite_job_checkpoint_last_timestamp_seconds", "When the last checkpoint was committed.", labels=["job_id"])
        ck_gap = GaugeMetricFamily("azulite_job_checkpoint_interval_seconds", "Seconds between the last two committed checkpoints.", labels=["job_id"])
        loss = GaugeMetricFamily("azulite_job_train_loss", "Last loss rank 0 logged (NaN/Inf as logged).", labels=["job_id"])
        step = GaugeMetricFamily("azulite_job_train_step", "Step of the last loss rank 0 logged.", labels=["job_id"])
        ck_ok = GaugeMetricFamily("azulite_job_checkpoints_readable", "0 when the job's checkpoint location cannot be read.", labels=["job_id"])
        for rec in recs:
            state.add_metric([rec.id, rec.name, rec.state.value], 1)
            attempts.add_metric([rec.id], rec.attempt)
            per_rank: dict[int, int] = {}
            for p in rec.processes:
                if p.kind == "rank" and p.rank is not None:
                    per_rank[p.rank] = per_rank.get(p.rank, 0) + (p.restarts or 0)
            for rank, n in sorted(per_rank.items()):
                restarts.add_metric([rec.id, str(rank)], n)
            if rec.state != JobState.RUNNING:
                continue  # progress and checkpoint age matter while it runs; reading storage costs
            t = last_progress(rec)
            if t is not None:
                progress.add_metric([rec.id], t)
            sl = last_loss(rec)
            if sl is not None:
                step.add_metric([rec.id], sl[0])
                loss.add_metric([rec.id], sl[1])
            try:
                ck = checkpoint_times(rec, self.environ)
            except (AzuliteError, OSError, ValueError):
                ck_ok.add_metric([rec.id], 0)
                continue
            ck_ok.add_metric([rec.id], 1)
            if ck is not None:
                ck_step.add_metric([rec.id], ck[0])
                ck_time.add_metric([rec.id], ck[1])
                if ck[2] is not None:
                    ck_gap.add_metric([rec.id], ck[2])
        yield from (state, attempts, restarts, progress, loss, step, ck_step, ck_time, ck_gap, ck_ok)
