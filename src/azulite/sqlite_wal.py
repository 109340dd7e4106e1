"""Opening a SQLite file in WAL mode, with its schema, from several processes at once.

WAL lets readers run beside the one writer and ``busy_timeout`` makes writers queue, but the switch of a
fresh file to WAL takes an exclusive lock, and SQLite answers "database is locked" at once, without
running the busy handler, when another process holds the file at that moment (measured: 6 processes
opening a fresh file together, the job store failed in 10 of 100 rounds, the key store in 24 of 100). So
the switch is tried again, with backoff, for as long as a write would wait; a file already in WAL is not
switched. Used by the local job store (``launch/local/store.py``) and the key store (``serve/keystore.py``).
"""

from __future__ import annotations

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
