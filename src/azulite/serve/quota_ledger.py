"""The day's quota usage kept across restarts: each key's inference requests of the current UTC day, in a
SQLite file beside the key store (``<key store>.usage``, or ``--quota-ledger FILE``).

The counts live where the guard takes them (serve/ratelimit.py's DailyQuotas in one process,
serve/sharedstate.py's slot file across ``--workers``): the request path never touches this file. A
guard seeds its counters from the ledger when it starts and writes the counts that moved every
``FLUSH_S`` from a thread of its own, and once more when it closes; a write keeps the larger of the
stored and the new count (``MAX``), so the workers of one server writing the same shared counts, in any
order, agree. What a server killed with ``kill -9`` took in its last ``FLUSH_S`` is not in the file: a
restart gives that much back, never more. Days before yesterday are dropped as the ledger is opened.

Why SQLite and a file of its own: the key store's own file would do, but every write there moves its
WAL-index header, which the guards watch to see revocations (keystore.CommitWatch): each flush would
make every worker reload its keys and forget its verified tokens."""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from azulite.errors import KeyStoreError
from azulite.sqlite_wal import create_private

log = logging.getLogger("azulite.serve.auth")

FLUSH_S = 1.0
_SCHEMA = ("CREATE TABLE IF NOT EXISTS usage (name TEXT NOT NULL, day INTEGER NOT NULL, used INTEGER NOT NULL, "
           "PRIMARY KEY (name, day))")


def ledger_path(key_store: Path) -> Path:
    """Where a key store's ledger lies by default: beside it."""
    return Path(f"{key_store}.usage")


class QuotaLedger:
    """``load(day)`` -> {key name: requests used that day}; ``save(day, counts)`` keeps the larger."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            create_private(self.path)  # key names and their use: the owner's only (0600)
            self._db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise KeyStoreError(f"the quota ledger {str(self.path)!r} cannot be used: {exc}",
                                fix="point --quota-ledger at a writable file (a volume that outlives the server)"
                                ) from None
        self._lock = threading.Lock()

    def load(self, day: int) -> dict[str, int]:
        with self._lock:
            self._db.execute("DELETE FROM usage WHERE day < ?", (day - 1,))
            return dict(self._db.execute("SELECT name, used FROM usage WHERE day = ?", (day,)).fetchall())

    def save(self, day: int, counts: Iterable[tuple[str, int]]) -> None:
        rows = [(name, day, used) for name, used in counts]
        if not rows:
            return
        with self._lock:
            self._db.executemany("INSERT INTO usage (name, day, used) VALUES (?, ?, ?) ON CONFLICT (name, day) "
                                 "DO UPDATE SET used = MAX(used, excluded.used)", rows)

    def close(self) -> None:
        with self._lock:
            self._db.close()


class LedgerWriter:
    """The guard's thread writing ``counts()`` (-> (day, [(name, used), ...]) of the counters now) to the
    ledger every ``interval_s`` when they moved; ``stop()`` writes them once more."""

    def __init__(self, ledger: QuotaLedger, counts: Callable[[], tuple[int, list[tuple[str, int]]]],
                 interval_s: float = FLUSH_S) -> None:
        self.ledger, self.counts, self.interval_s = ledger, counts, interval_s
        self._written: dict[tuple[str, int], int] = {}
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="azulite-quota-ledger", daemon=True)
        self._thread.start()

    def flush(self) -> None:
        day, counts = self.counts()
        moved = [(name, used) for name, used in counts if used and self._written.get((name, day)) != used]
        try:
            self.ledger.save(day, moved)
        except sqlite3.Error as exc:  # the counts stay right in memory; only a restart would give some back
            if not self._failed:
                log.error("the quota ledger %s cannot be written (%s): a restart would reset today's quotas",
                          self.ledger.path, exc)
            self._failed = True
            return
        self._failed = False
        if len(self._written) > 65536:
            self._written.clear()
        self._written.update(((name, day), used) for name, used in moved)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.flush()
