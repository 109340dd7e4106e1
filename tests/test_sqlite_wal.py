"""sqlite_wal.open_wal on real SQLite files and real processes: a fresh file opened by several processes at
the same moment ends in WAL mode for all of them (SQLite refuses the switch with "database is locked" at
once, without its busy wait, to all but one); any other error is raised as it is. ``opened_at_once`` is also
what the job store's and the key store's tests run."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
from collections.abc import Callable

import pytest

from azulite.sqlite_wal import open_wal

SCHEMA = "CREATE TABLE IF NOT EXISTS t (k TEXT PRIMARY KEY, v INTEGER);"


def _open_rounds(opener: Callable[[str], object], paths: list[str], barrier, q) -> None:
    for db in paths:
        barrier.wait()  # every process opens the round's fresh file at the same moment
        try:
            opener(db)
            q.put((db, "ok"))
        except Exception as e:  # noqa: BLE001 - the test reports what it was
            q.put((db, f"{type(e).__name__}: {e}"))


def opened_at_once(tmp_path, opener: Callable[[str], object], rounds: int, n: int = 6) -> None:
    """``rounds`` fresh files, each opened by ``n`` processes at once with ``opener(path)``: all succeed and
    the file is in WAL mode. The processes are spawned, not forked: a fork of the test process (whose other
    threads may hold an import or logging lock at that moment) could hang in the child, as it once did in CI;
    and they are spawned once and open every round's file, so the rounds cost no process start each."""
    ctx = mp.get_context("spawn")
    paths = [str(tmp_path / f"fresh-{r}.db") for r in range(rounds)]
    barrier, q = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_open_rounds, args=(opener, paths, barrier, q), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        got: dict[str, list[str]] = {db: [] for db in paths}
        for _ in range(rounds * n):  # a process's next round may arrive before another's last one
            db, result = q.get(timeout=120)
            got[db].append(result)
        failed = {db: results for db, results in got.items() if results != ["ok"] * n}
        assert not failed, failed
        for db in paths:
            assert sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0] == "wal", db
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0, p.exitcode
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def _open_plain(db: str) -> None:
    conn, mode = open_wal(lambda: sqlite3.connect(db, timeout=30, isolation_level=None), SCHEMA, retry_s=30)
    assert mode == "wal"
    conn.close()


def test_a_fresh_file_opened_by_several_processes_at_once_opens_for_all(tmp_path):
    opened_at_once(tmp_path, _open_plain, 20)


def test_a_file_already_in_wal_is_not_switched_and_the_schema_is_idempotent(tmp_path):
    db = str(tmp_path / "a.db")
    conn, mode = open_wal(lambda: sqlite3.connect(db, isolation_level=None), SCHEMA, retry_s=1)
    conn.execute("INSERT INTO t VALUES ('a', 1)")
    conn.close()
    statements: list[str] = []

    def connect():
        c = sqlite3.connect(db, isolation_level=None)
        c.set_trace_callback(statements.append)
        return c

    conn, mode = open_wal(connect, SCHEMA, retry_s=1)
    assert mode == "wal" and conn.execute("SELECT v FROM t").fetchall() == [(1,)]
    assert "PRAGMA journal_mode" in statements and "PRAGMA journal_mode=WAL" not in statements
    conn.close()


def test_an_error_that_is_not_a_lock_is_raised_at_once(tmp_path):
    calls = []

    def connect():
        calls.append(1)
        return sqlite3.connect(str(tmp_path / "b.db"), isolation_level=None)

    with pytest.raises(sqlite3.OperationalError, match="syntax error"):
        open_wal(connect, "CREATE TABLE (", retry_s=60)
    assert len(calls) == 1  # not retried
