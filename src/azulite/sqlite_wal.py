"""Opening a SQLite file in WAL mode, with its schema, from several processes at once.

WAL lets readers run beside the one writer and ``busy_timeout`` makes writers queue, but the switch of a
fresh file to WAL takes an exclusive lock, and SQLite answers "database is locked" at once, without
running the busy handler, when another process holds the file at that moment (measured: 6 processes
opening a fresh file together, the job store failed in 10 of 100 rounds, the key store in 24 of 100). So
the switch is tried again, with backoff, for as long as a write would wait; a file already in WAL is not
switched. Used by the local job store (``launch/local/store.py``) and the key store (``serve/keystore.py``).
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable


def open_wal(connect: Callable[[], sqlite3.Connection], schema: str, *,
             retry_s: float) -> tuple[sqlite3.Connection, str]:
    """A connection from ``connect()`` to a file in WAL mode with ``schema`` (idempotent DDL) applied, and
    the journal mode the file has (``wal``, or what SQLite kept where WAL cannot be: a file system without
    shared memory). A switch refused as locked is retried for ``retry_s`` seconds; any other error raises."""
    deadline, delay = time.monotonic() + retry_s, 0.005
    while True:
        conn = connect()
        try:
            mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
            if mode != "wal":
                mode = str(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
            conn.executescript(schema)
            return conn, mode
        except sqlite3.OperationalError as exc:
            conn.close()
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        except BaseException:
            conn.close()
            raise
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def create_private(path: str | os.PathLike) -> None:
    """Create the file (if missing) readable and writable by its owner only (0600), before SQLite opens it:
    SQLite gives its -wal and -shm files the database file's mode. For files that name clients or hold
    key hashes (the key store, the quota ledger), which the umask (022) would leave readable by all."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        pass
