"""The local job store: SQLite in WAL mode, the single source of truth about local jobs.

Every write is one short ``BEGIN IMMEDIATE`` transaction on a fresh connection, so any number of shells
and supervisors can use it at once (WAL lets readers run beside the one writer; ``busy_timeout`` makes
writers queue instead of failing). Job ids are ``<name>-<n>`` with ``n`` counted per name inside the
insert's transaction, so two concurrent submits of the same spec get distinct ids.

State changes go through :meth:`JobStore.transition`, which enforces :data:`TRANSITIONS` (a refused
transition returns False: e.g. a supervisor finishing a job that a cancel already ended).
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from azulite.errors import JobNotFound, StorageError
from azulite.launch.records import AttemptRecord, JobRecord, JobState, ProcessRecord, TRANSITIONS
from azulite.sqlite_wal import open_wal

_SCHEMA = """
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, n INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, backend TEXT NOT NULL, state TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, started_at REAL, ended_at REAL,
    exit_code INTEGER, reason TEXT, failed_rank INTEGER, spec TEXT NOT NULL, spec_path TEXT,
    environment TEXT, job_dir TEXT NOT NULL, supervisor_pid INTEGER,
    cancel_requested INTEGER NOT NULL DEFAULT 0, preempt_requested INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS attempts (
    job_id TEXT NOT NULL, attempt INTEGER NOT NULL, state TEXT NOT NULL, started_at REAL, ended_at REAL,
    exit_code INTEGER, reason TEXT, PRIMARY KEY (job_id, attempt)
);
CREATE TABLE IF NOT EXISTS processes (
    job_id TEXT NOT NULL, attempt INTEGER NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL,
    node INTEGER NOT NULL, rank INTEGER, local_rank INTEGER, pid INTEGER, exit_code INTEGER, log TEXT,
    restarts INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (job_id, attempt, kind, name)
);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL, ts REAL NOT NULL, state TEXT NOT NULL, message TEXT
);
CREATE INDEX IF NOT EXISTS events_job ON events (job_id, ts);
"""


#: the store's layout, in SQLite's ``user_version``: a store of an older azulite (0: before it was counted) gets
#: the columns added since; one of a newer azulite is refused with that said (it was a traceback)
SCHEMA_VERSION = 1


def _schema_columns() -> dict[str, dict[str, str]]:
    """Each table's columns as :data:`_SCHEMA` declares them (name -> type, NOT NULL, DEFAULT), read by
    SQLite itself from an in-memory copy: what an older store may lack is derived, never listed twice."""
    mem = sqlite3.connect(":memory:")
    try:
        mem.executescript(_SCHEMA)
        tables = [t for (t,) in mem.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: {name: " ".join(filter(None, (kind, "NOT NULL" if notnull else "",
                                                 f"DEFAULT {default}" if default is not None else "")))
                    for _, name, kind, notnull, default, _ in mem.execute(f"PRAGMA table_info({t})")}
                for t in tables}
    finally:
        mem.close()


#: how long opening the store retries a fresh file other processes open at the same moment (sqlite_wal.py):
#: as long as a write waits for the lock (``busy_timeout``)
_OPEN_RETRY_S = 60.0


class JobStore:
    def __init__(self, db_path: Path) -> None:
        self.db_path = Path(db_path)
        try:
            self.db_path.parent.mkdir(parents=True, exist_ok=True)
            conn, _ = open_wal(self._connect, _SCHEMA, retry_s=_OPEN_RETRY_S)
            try:
                self._migrate(conn)
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise StorageError(f"cannot open the job store: {exc}", where=str(self.db_path),
                               fix="check AZULITE_HOME points at a writable folder") from None

    def _migrate(self, conn: sqlite3.Connection) -> None:
        """An older store gets the columns added since (and its version); a newer one is refused."""
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StorageError(
                f"the job store was written by a newer azulite (store layout {version}; this one reads up to "
                f"{SCHEMA_VERSION})", where=str(self.db_path),
                fix="use that azulite, or point AZULITE_HOME at another folder for this one")
        if version == SCHEMA_VERSION:
            return
        conn.execute("BEGIN IMMEDIATE")
        try:  # every column of _SCHEMA the store lacks (its tables themselves: made by CREATE ... IF NOT EXISTS)
            for table, columns in _schema_columns().items():
                have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
                for name, decl in columns.items():
                    if name not in have:
                        conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.db_path, timeout=60, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA busy_timeout=60000")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        finally:
            conn.close()

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        conn = self._connect()
        try:
            yield conn
        finally:
            conn.close()

    # ---- jobs ----------------------------------------------------------------------------------------
    def create(self, *, name: str, backend: str, spec: dict, spec_path: str | None, environment: str | None,
               jobs_dir: Path) -> JobRecord:
        now = time.time()
        with self._tx() as db:
            row = db.execute("SELECT n FROM counters WHERE name=?", (name,)).fetchone()
            n = (row["n"] if row else 0) + 1
            db.execute("INSERT OR REPLACE INTO counters (name, n) VALUES (?, ?)", (name, n))
            job_id = f"{name}-{n}"
            job_dir = str(Path(jobs_dir) / job_id)
            db.execute(
                "INSERT INTO jobs (id, name, backend, state, created_at, spec, spec_path, environment, job_dir)"
                " VALUES (?,?,?,?,?,?,?,?,?)",
                (job_id, name, backend, JobState.QUEUED.value, now, json.dumps(spec), spec_path, environment, job_dir),
            )
            db.execute("INSERT INTO events VALUES (?,?,?,?)", (job_id, now, JobState.QUEUED.value, "submitted"))
        return self.get(job_id)

    def transition(self, job_id: str, to: JobState, *, message: str | None = None, attempt: int | None = None,
                   exit_code: int | None = None, failed_rank: int | None = None) -> bool:
        """Move the job (and its current attempt row) to ``to`` if allowed; False if refused."""
        now = time.time()
        with self._tx() as db:
            row = db.execute("SELECT state, attempt, started_at FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None:
                raise JobNotFound(f"no job {job_id!r}", fix="list jobs with `azulite job list`")
            cur = JobState(row["state"])
            if to not in TRANSITIONS[cur]:
                return False
            att = row["attempt"] if attempt is None else attempt
            sets = {"state": to.value, "attempt": att}
            if to == JobState.RUNNING:
                if row["started_at"] is None:
                    sets["started_at"] = now
                db.execute(
                    "INSERT OR REPLACE INTO attempts (job_id, attempt, state, started_at) VALUES (?,?,?,?)",
                    (job_id, att, to.value, now),
                )
            else:
                db.execute(
                    "UPDATE attempts SET state=?, ended_at=COALESCE(ended_at, ?), exit_code=COALESCE(?, exit_code),"
                    " reason=COALESCE(?, reason) WHERE job_id=? AND attempt=?",
                    (to.value, now, exit_code, message, job_id, att),
                )
            if to.terminal:
                sets.update(ended_at=now, exit_code=exit_code, reason=message, failed_rank=failed_rank)
            if to == JobState.REQUEUED:
                sets["preempt_requested"] = 0
            cols = ", ".join(f"{k}=?" for k in sets)
            db.execute(f"UPDATE jobs SET {cols} WHERE id=?", (*sets.values(), job_id))
            db.execute("INSERT INTO events VALUES (?,?,?,?)", (job_id, now, to.value, message))
        return True

    def set_fields(self, job_id: str, **fields: object) -> None:
        allowed = {"supervisor_pid", "cancel_requested", "preempt_requested", "reason"}
        assert set(fields) <= allowed, fields
        with self._tx() as db:
            cols = ", ".join(f"{k}=?" for k in fields)
            db.execute(f"UPDATE jobs SET {cols} WHERE id=?", (*fields.values(), job_id))

    def claim_supervision(self, job_id: str, seen: int | None, token: int) -> bool:
        """Swap the job's supervisor pid from ``seen`` (a dead one) to ``token`` in one conditional write:
        of several commands that notice the same dead supervisor, exactly one gets to start a new one."""
        with self._tx() as db:
            cur = db.execute("UPDATE jobs SET supervisor_pid=? WHERE id=? AND supervisor_pid IS ?", (token, job_id, seen))
            return cur.rowcount == 1

    def request_preempt(self, job_id: str) -> bool:
        """Flag a running job for preemption in one conditional write (no check-then-act race with the
        supervisor's own transitions); False if it is not running."""
        with self._tx() as db:
            n = db.execute("UPDATE jobs SET preempt_requested=1 WHERE id=? AND state=?",
                           (job_id, JobState.RUNNING.value)).rowcount
        return n == 1

    def flags(self, job_id: str) -> tuple[bool, bool]:
        """(cancel_requested, preempt_requested)"""
        with self._read() as db:
            row = db.execute("SELECT cancel_requested, preempt_requested FROM jobs WHERE id=?", (job_id,)).fetchone()
        return (bool(row[0]), bool(row[1])) if row else (False, False)

    def event(self, job_id: str, message: str) -> None:
        with self._tx() as db:
            state = db.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()
            db.execute("INSERT INTO events VALUES (?,?,?,?)", (job_id, time.time(), state[0] if state else "?", message))

    # ---- processes -----------------------------------------------------------------------------------
    def record_processes(self, job_id: str, procs: list[ProcessRecord]) -> None:
        with self._tx() as db:
            db.executemany(
                "INSERT OR REPLACE INTO processes VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                [(job_id, p.attempt, p.kind, p.name, p.node, p.rank, p.local_rank, p.pid, p.exit_code, p.log, p.restarts)
                 for p in procs],
            )

    # ---- reading -------------------------------------------------------------------------------------
    def get(self, job_id: str) -> JobRecord:
        with self._read() as db:
            row = db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None:
                close = [r[0] for r in db.execute("SELECT id FROM jobs ORDER BY created_at DESC LIMIT 5")]
                raise JobNotFound(
                    f"no job {job_id!r} in {self.db_path}",
                    fix="list jobs with `azulite job list`" + (f" (recent: {', '.join(close)})" if close else ""),
                )
            procs = db.execute(
                "SELECT * FROM processes WHERE job_id=? ORDER BY attempt, kind, node, rank, name", (job_id,)
            ).fetchall()
            attempts = db.execute("SELECT * FROM attempts WHERE job_id=? ORDER BY attempt", (job_id,)).fetchall()
            events = db.execute("SELECT ts, state, message FROM events WHERE job_id=? ORDER BY ts, rowid", (job_id,)).fetchall()
        rec = self._job(row)
        rec.processes = [
            ProcessRecord(attempt=p["attempt"], kind=p["kind"], name=p["name"], node=p["node"], rank=p["rank"],
                          local_rank=p["local_rank"], pid=p["pid"], exit_code=p["exit_code"], log=p["log"],
                          restarts=p["restarts"])
            for p in procs
        ]
        rec.attempts = [
            AttemptRecord(attempt=a["attempt"], state=a["state"], started_at=a["started_at"], ended_at=a["ended_at"],
                          exit_code=a["exit_code"], reason=a["reason"])
            for a in attempts
        ]
        rec.events = [dict(e) for e in events]
        return rec

    def list(self, limit: int = 50) -> list[JobRecord]:
        with self._read() as db:
            rows = db.execute("SELECT * FROM jobs ORDER BY created_at DESC, rowid DESC LIMIT ?", (limit,)).fetchall()
        return [self._job(r) for r in rows]

    def active(self) -> list[JobRecord]:
        """Every job that has not ended, however old, oldest first (``list`` sees only the newest)."""
        ended = tuple(s.value for s in JobState if s.terminal)
        with self._read() as db:
            rows = db.execute(f"SELECT * FROM jobs WHERE state NOT IN ({','.join('?' * len(ended))}) "
                              "ORDER BY created_at, rowid", ended).fetchall()
        return [self._job(r) for r in rows]

    def _job(self, row: sqlite3.Row) -> JobRecord:
        try:
            state = JobState(row["state"])
        except ValueError:  # one row of a newer azulite broke every listing with a traceback
            raise StorageError(f"job {row['id']} is in state {row['state']!r}, which this azulite does not know",
                               where=str(self.db_path), fix="use the azulite that wrote it, or point AZULITE_HOME "
                               "at another folder for this one") from None
        return JobRecord(
            id=row["id"], name=row["name"], backend=row["backend"], state=state,
            attempt=row["attempt"], created_at=row["created_at"], started_at=row["started_at"],
            ended_at=row["ended_at"], exit_code=row["exit_code"], reason=row["reason"], spec=json.loads(row["spec"]),
            spec_path=row["spec_path"], environment=row["environment"], job_dir=row["job_dir"],
            supervisor_pid=row["supervisor_pid"], failed_rank=row["failed_rank"],
        )
