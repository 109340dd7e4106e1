"""The audit log: one JSON line per request (time, request id, key id — never the secret —, client
address, model, version, protocol, status, latency, bytes in/out), written by a thread, never on the
request path.

The request path only appends a tuple to a queue (``SimpleQueue.put``: lock-free enough to cost well
under a microsecond); a daemon thread formats and writes. Rotation by size is the standard library's
``RotatingFileHandler`` (well kept; it renames ``audit.log`` -> ``audit.log.1`` ...). A write that fails
(disk full, file removed, permissions) never reaches a request: it is counted in ``write_errors``
(exported as ``azulite_audit_write_errors``) and the line is dropped. When the queue passes
``max_pending`` lines (a disk slower than the traffic) lines are dropped and counted too, so memory
stays bounded.
"""

from __future__ import annotations

import itertools
import json
import logging
import logging.handlers
import os
import queue
import threading
import time
from pathlib import Path

_STOP = object()
FIELDS = ("time", "request_id", "key_id", "client", "model", "version", "protocol", "status", "latency_ms",
          "bytes_in", "bytes_out")


class _Handler(logging.handlers.RotatingFileHandler):
    def __init__(self, log: "AuditLog", *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._audit = log

    def handleError(self, record) -> None:  # noqa: N802 - logging's name
        self._audit.write_errors += 1


class AuditLog:
    """``record(...)`` from any thread; ``close()`` flushes what is queued and stops the writer."""

    def __init__(self, path: Path | str, *, max_bytes: int = 64 * 1024 * 1024, backups: int = 5,
                 max_pending: int = 100_000) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write_errors = 0
        self.dropped = 0
        self.written = 0
        self.max_pending = max_pending
        # delay=True: the file opens at the first line, so a missing folder later is a counted failure
        self._handler = _Handler(self, str(self.path), maxBytes=max_bytes, backupCount=backups, delay=True,
                                 encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._boot = f"{os.getpid():x}{int(time.time()) & 0xFFFFFF:06x}"
        self._thread = threading.Thread(target=self._run, name="azulite-audit", daemon=True)
        self._thread.start()

    def request_id(self) -> str:
        """A server-side id for requests that bring none (unique per server start)."""
        return f"{self._boot}-{next(self._ids)}"

    def record(self, *, request_id: str, key_id: str | None, client: str, model: str, version: str, protocol: str,
               status: int | str, latency_s: float, bytes_in: int, bytes_out: int) -> None:
        if self._queue.qsize() >= self.max_pending:
            self.dropped += 1
            return
        self._queue.put((time.time(), request_id, key_id, client, model, version, protocol, status,
                         round(latency_s * 1000.0, 3), bytes_in, bytes_out))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                line = json.dumps(dict(zip(FIELDS, item)), separators=(",", ":"))
            except (TypeError, ValueError):
                self.write_errors += 1
                continue
            record = logging.makeLogRecord({"msg": line, "levelno": logging.INFO, "levelname": "INFO"})
            before = self.write_errors
            self._handler.handle(record)
            if self.write_errors == before:
                self.written += 1
                try:
                    self._handler.flush()
                except OSError:
                    self.write_errors += 1

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every line recorded before this call is written (or failed)."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout_s)
        self._handler.close()
