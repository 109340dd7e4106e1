"""The audit log: one JSON line per request (time, request id, key id — never the secret —, client
address, model, version, protocol, status, latency, bytes in/out), formatted and written by a process of
its own (serve/audit_writer.py), never on the request path nor under the server's GIL.

The request path only appends a tuple of raw values to a list (``list.append``, atomic under the
GIL; its time is ``perf_counter``'s, converted to wall time by the writer). A daemon thread wakes every
``batch_s`` (never per request), takes what gathered and hands it to the writer process in one pipe
write, as one ``marshal`` blob (C speed), then waits — off the GIL, in a read — for the writer's
acknowledgement: lines written, lines lost to a failed write. Why a process: see audit_writer.py.

Rotation by size is the standard library's ``RotatingFileHandler.doRollover`` (it renames
``audit.log`` -> ``audit.log.1``...). A write that fails (disk full, file removed, permissions) never
reaches a request: it is counted in ``write_errors`` (exported as ``azulite_audit_write_errors``) and
the line is dropped; a writer process that dies loses the batch it was handed (counted the same) and is
started again for the next one. When the queue passes ``max_pending`` lines (a disk slower than the
traffic) lines are dropped and counted too, so memory stays bounded.

Shutdown: ``close()`` (the server's SIGTERM/SIGINT path, and an exit hook for an interpreter that ends
without it) hands over what is queued and waits for the writer to write it. A server killed with
SIGKILL loses the lines it had not yet handed over (at most ``batch_s`` of them, as the thread writer
did before); the writer still writes every line it had received, then exits.

Several worker processes of one server (``ServerSettings.shared_state_dir``) write the one log: each
writer writes a batch under an exclusive ``flock`` of a lock file in that directory (lines never
interleave), the size that decides a rotation is the file's own (every worker's lines), and a writer
whose file was rotated by another reopens the new one before writing.
"""

from __future__ import annotations

import atexit
import marshal
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from azulite.serve.audit_writer import ACK, FRAME, read_exactly

_STOP = object()
_now = time.perf_counter
FIELDS = ("time", "request_id", "key_id", "client", "model", "version", "protocol", "status", "latency_ms",
          "bytes_in", "bytes_out")
_SRC = str(Path(__file__).resolve().parents[2])  # the writer imports the azulite this process runs


class AuditLog:
    """``record(...)`` from any thread; ``close()`` flushes what is queued and stops the writer."""

    def __init__(self, path: Path | str, *, max_bytes: int = 64 * 1024 * 1024, backups: int = 5,
                 max_pending: int = 100_000, batch_s: float = 0.1, shared_lock: Path | None = None) -> None:
        """``shared_lock``: a lock file the other worker processes of the server writing this same log
        also use (ServerSettings.shared_state_dir): each batch is written and each rotation done under
        it, so lines never interleave and a rotation by one worker is followed by the others."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if shared_lock is not None:
            Path(shared_lock).parent.mkdir(parents=True, exist_ok=True)
        self._args = [str(self.path), str(int(max_bytes)), str(int(backups)),
                      str(shared_lock) if shared_lock is not None else "",
                      f"{os.getpid():x}{int(time.time()) & 0xFFFFFF:06x}"]  # server-assigned ids: unique per start
        self.write_errors = 0
        self.dropped = 0
        self.written = 0
        self.max_pending = max_pending
        self.batch_s = batch_s
        #: lines waiting for the writer: the request path appends; the thread copies the first n and
        #: deletes them (``q[:n]``, ``del q[:n]``: each one C call, atomic under the GIL, so a line appended
        #: in between stays for the next batch) — no per-line pop in Python
        self._queue: list = []
        self._signals = 0  # flush events / the stop marker in the queue: only then is a batch sorted
        self._signal_lock = threading.Lock()  # flush() and close() from any thread, the thread's count
        self._proc: subprocess.Popen | None = None
        self._wake = threading.Event()  # flush and close wake the thread early; requests never do
        self._start_writer()
        self._thread = threading.Thread(target=self._run, name="azulite-audit", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # an interpreter exiting without close() still writes what is queued

    def record(self, request_id: str | None, key_id: str | None, client: str, model: str, version: str,
               protocol: str, status: int | str, latency_s: float, bytes_in: int, bytes_out: int) -> None:
        """Queue one line (positional, in FIELDS order, for speed: this runs on every request). A
        request_id of None gets the server's own id, assigned by the writer."""
        q = self._queue
        if len(q) >= self.max_pending:
            self.dropped += 1
            return
        q.append((_now(), request_id, key_id, client, model, version, protocol, status, latency_s,
                  bytes_in, bytes_out))

    # --- the thread: hand batches to the writer process ------------------------------------------------

    def _start_writer(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, env.get("PYTHONPATH", "")) if p)
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "azulite.serve.audit_writer", *self._args],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        except (OSError, ValueError, TypeError):  # no interpreter to run (sys.executable unknown), no fds
            self._proc = None  # counted, batch by batch, until a start succeeds

    def _stop_writer(self, timeout_s: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            proc.wait(timeout_s)  # it writes what it holds, then exits on the closed pipe
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _run(self) -> None:
        # Wake at most every batch_s and hand over what gathered in one write: a thread woken per line
        # would take the GIL from the event loop thousands of times a second (measured: half the
        # throughput at 8k requests/s).
        stop = False
        while not stop:
            # sleep, then drain without blocking: a getter blocked in get() would be woken by each
            # put, and that wake-up hands the GIL over (measured: 86 us of the request path per line)
            self._wake.wait(self.batch_s)
            self._wake.clear()
            q = self._queue
            n = len(q)
            batch = q[:n]
            del q[:n]
            events = []
            if self._signals:
                records = []
                for item in batch:
                    if type(item) is tuple:
                        records.append(item)
                    else:
                        with self._signal_lock:
                            self._signals -= 1
                        if item is _STOP:
                            stop = True
                        else:
                            events.append(item)
            else:
                records = batch
            if records:
                self._send(records)
            for event in events:
                event.set()
        self._stop_writer()

    def _send(self, records: list[tuple]) -> None:
        try:
            blob = marshal.dumps((time.time() - time.perf_counter(), records))
        except ValueError:  # a value marshal cannot carry (a caller's own type): those lines only are lost
            keep = []
            for r in records:
                try:
                    marshal.dumps(r)
                    keep.append(r)
                except ValueError:
                    self.write_errors += 1
            records = keep
            blob = marshal.dumps((time.time() - time.perf_counter(), records))
        if self._proc is None or self._proc.poll() is not None:
            self._stop_writer(0.0)
            self._start_writer()
        proc = self._proc
        if proc is None:
            self.write_errors += len(records)
            return
        try:
            proc.stdin.write(FRAME.pack(len(blob)) + blob)
            proc.stdin.flush()
            ack = read_exactly(proc.stdout.fileno(), ACK.size)
        except (OSError, ValueError):
            ack = b""
        if len(ack) != ACK.size:  # the writer died with the batch: lost, and a new one next time
            self.write_errors += len(records)
            self._stop_writer(5.0)
            return
        written, errors = ACK.unpack(ack)
        self.written += written
        self.write_errors += errors

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every line recorded before this call is written (or failed)."""
        done = threading.Event()
        with self._signal_lock:  # before the append: the thread never meets a signal it was not told of
            self._signals += 1
        self._queue.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        atexit.unregister(self.close)
        if self._thread.is_alive():
            with self._signal_lock:
                self._signals += 1
            self._queue.append(_STOP)
            self._wake.set()
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._stop_writer()
