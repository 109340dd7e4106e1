"""The audit log: one JSON line per request (time, request id, key id — never the secret —, client
address, model, version, protocol, status, latency, bytes in/out), formatted and written by a process of
its own (serve/audit_writer.py), never on the request path nor under the server's GIL.

The request path packs the record's raw values into a shared-memory ring (one ``struct.pack_into``;
its time is ``perf_counter``'s, the system's monotonic clock, which the writer converts to wall time):
no thread on the server's side, no pipe write, no wake-up. The writer process reads the ring on its own
timer (every ``batch_s``) and formats, rotates and writes there (the ring's layout: audit_writer.py). The
fields a client repeats (key id, address, model, version, protocol, status) are sent once per distinct
combination as a small id's definition (bounded: 4096, then forgotten and defined again); a request id
longer than audit_writer.RID_MAX bytes is cut, and its line marked ``...(truncated)``.

Rotation by size is the standard library's ``RotatingFileHandler.doRollover`` (it renames
``audit.log`` -> ``audit.log.1``...). A write that fails (disk full, file removed, permissions) never
reaches a request: it is counted in ``write_errors`` (exported as ``azulite_audit_write_errors_total``) and
the line is dropped. When the ring is full (the writer fell behind ``max_pending`` lines: a disk slower
than the traffic, or a writer that died) the record is dropped and counted in ``dropped``, never waited
for. A writer process that died is started again when the ring fills (at the latest every 4096 records)
or at a flush, and goes on from where the ring says its predecessor stopped (a predecessor killed between
its write and its bookkeeping has its last read written twice, never lost).

Shutdown: ``close()`` (the server's SIGTERM/SIGINT path, and an exit hook for an interpreter that ends
without it) closes the writer's stdin; it reads the ring one last time, writes everything, and exits.
A server killed with SIGKILL loses nothing it had packed: the writer holds the ring's memory too, sees
its stdin close, reads the ring to its end and writes it (only a record being packed at the very
instant of the kill is lost).

Several worker processes of one server (``ServerSettings.shared_state_dir``) write the one log: each
front end has its ring and writer, and each writer writes a batch under an exclusive ``flock`` of a lock
file in that directory (lines never interleave), the size that decides a rotation is the file's own
(every worker's lines), and a writer whose file was rotated by another reopens the new one before writing.

``record`` is called from one thread (the server's event loop, where HTTP, HTTP/2 and grpc.aio all run);
``flush`` and ``close`` from any.
"""

from __future__ import annotations

import atexit
import marshal
import mmap
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from struct import error as StructError
from pathlib import Path

from azulite.errors import AuditError
from azulite.serve.audit_writer import (COUNTS, DEFINE_END, DEFINE_MORE, FRAME, HEADER, NO_RID, RID, RID_CUT,
                                        RID_MAX, SLOT)

_now = time.perf_counter
_pack = SLOT.pack_into
FIELDS = ("time", "request_id", "key_id", "client", "model", "version", "protocol", "status", "latency_ms",
          "bytes_in", "bytes_out")
_SRC = str(Path(__file__).resolve().parents[2])  # the writer imports the azulite this process runs
_IDS = 4096  # distinct (key, client, model, version, protocol, status) kept defined
_CHECK_EVERY = 4096  # records between two looks at the writer's progress (and life) at most
_FIELD_MAX = 1024  # characters of a defined field kept (a hostile model name must not fill the ring)


def _ring_file(size: int) -> int:
    """An anonymous shared-memory file of ``size`` bytes (nothing to clean up: it lives as long as an fd)."""
    try:
        fd = os.memfd_create("azulite-audit", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # no memfd: an unlinked temporary file
        fd, name = tempfile.mkstemp(prefix="azulite-audit-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.unlink(name)
    os.ftruncate(fd, size)
    return fd


#: the shortest key taken: HMAC-SHA256's security is the key's, and a short one can be guessed
KEY_MIN = 16


def read_key(path: Path | str, flag: str = "--audit-key") -> bytes:
    """A seal key file's bytes (trailing newline kept: the file is the key, as written)."""
    try:
        key = Path(path).read_bytes()
    except OSError as exc:
        raise AuditError(f"cannot read the seal key: {exc.strerror or exc}", where=f"{flag} {path}",
                         fix="name a readable key file, e.g. made with: head -c 32 /dev/urandom > audit.key") from None
    if len(key) < KEY_MIN:
        raise AuditError(f"the seal key is {len(key)} bytes; at least {KEY_MIN} are needed", where=f"{flag} {path}",
                         fix="make a longer one, e.g. head -c 32 /dev/urandom > audit.key")
    return key


class AuditLog:
    """``record(...)`` from the event loop; ``flush()`` / ``close()`` from any thread."""

    def __init__(self, path: Path | str, *, max_bytes: int = 64 * 1024 * 1024, backups: int = 5,
                 max_pending: int = 32768, batch_s: float = 0.1, shared_lock: Path | None = None,
                 seal: bytes | None = None) -> None:
        """``max_pending``: records the ring holds for the writer (its memory: 128 bytes each).
        ``shared_lock``: a lock file the other worker processes of the server writing this same log
        also use (ServerSettings.shared_state_dir): each batch is written and each rotation done under
        it, so lines never interleave and a rotation by one worker is followed by the others.
        ``seal``: None, no seal lines; b"", SHA-256 seals; a key, HMAC-SHA256 seals (audit_writer.py)."""
        self.seal = seal
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if shared_lock is not None:
            Path(shared_lock).parent.mkdir(parents=True, exist_ok=True)
        self.max_pending = max(0, int(max_pending))
        slots = 1
        while slots < self.max_pending:
            slots *= 2
        self._mask = slots - 1
        self._fd = _ring_file(HEADER + slots * SLOT.size)
        self._buf = mmap.mmap(self._fd, HEADER + slots * SLOT.size)
        self._args = [str(self.path), str(int(max_bytes)), str(int(backups)),
                      str(shared_lock) if shared_lock is not None else "",
                      f"{os.getpid():x}{int(time.time()) & 0xFFFFFF:06x}",  # server-assigned ids: unique per start
                      str(self._fd), repr(float(batch_s))]
        self.batch_s = batch_s
        self.dropped = 0
        self._lost = 0  # lines this side could not hand over (a value marshal cannot carry, no writer)
        self._final: tuple[int, int, int] | None = None  # the writer's counts, kept at close
        self._w = 0  # the next record's index (its sequence is w + 1)
        self._limit = 0  # records up to here fit without looking at the writer's progress again
        self._refused = 0  # records the full ring refused in a row, less or more: when to look at the writer
        self._ids: dict[tuple, int] = {}  # the fields a client repeats -> their defined id
        self._next_id = 1
        self._forget = False  # ids were forgotten: the writer must be told before the next define
        self._ctl = threading.Lock()  # flush, close, and a writer's start
        self._proc: subprocess.Popen | None = None
        self._start_writer()
        atexit.register(self.close)  # an interpreter exiting without close() still writes what is queued

    # --- the request path ----------------------------------------------------------------------------

    def record(self, request_id: str | bytes | None, key_id: str | None, client: str, model: str, version: str,
               protocol: str, status: int | str, latency_s: float, bytes_in: int, bytes_out: int,
               at: float | None = None) -> None:
        """Pack one line's values into the ring (positional, in FIELDS order, for speed: this runs on every
        request). A request_id of None gets the server's own id, assigned by the writer. ``at``: the
        line's time as ``time.perf_counter()`` read it (the caller's own end-of-request read; None: now)."""
        who = (key_id, client, model, version, protocol, status)
        try:
            ident = self._ids.get(who)
        except TypeError:  # a caller's unhashable value: that line is lost, counted
            self._lost += 1
            return
        w = self._w
        if ident is None or w >= self._limit:
            ident = self._room(who, ident)
            if ident is None:
                return
            w = self._w
        try:  # (free in 3.11 when nothing is raised)
            if request_id is None:
                _pack(self._buf, HEADER + ((w & self._mask) << 7), _now() if at is None else at, latency_s, bytes_in,
                      bytes_out, ident, NO_RID, b"", w + 1)
            else:
                if type(request_id) is not bytes:
                    request_id = str(request_id).encode("utf-8", "replace")
                _pack(self._buf, HEADER + ((w & self._mask) << 7), _now() if at is None else at, latency_s, bytes_in,
                      bytes_out, ident, RID if len(request_id) <= RID_MAX else RID_CUT, request_id, w + 1)
        except (StructError, TypeError, ValueError):  # a value the slot cannot hold: that line is lost, counted
            self._lost += 1
            return
        self._w = w + 1

    def _room(self, who: tuple, ident: int | None) -> int | None:
        """The slow path of ``record``: room for one record (and the define of ``who`` when it has no id
        yet) -> its id, or None when the record is dropped (counted)."""
        if self._buf is None:  # closed
            self.dropped += 1
            return None
        define = None
        if ident is None:
            if len(self._ids) >= _IDS:
                self._ids = {}
                self._forget = True
            try:
                define = marshal.dumps(tuple(v[:_FIELD_MAX] if type(v) is str else v for v in who))
            except ValueError:  # a value marshal cannot carry (a caller's own type): the line is lost
                self._lost += 1
                return None
        need = 1 + (0 if define is None else -(-len(define) // RID_MAX) + (2 if self._forget else 0))
        if not self._fits(need):
            self.dropped += 1
            return None
        if define is not None:
            if self._forget:
                self._put_define(0, marshal.dumps(None))
                self._forget = False
            ident = self._next_id
            self._next_id = ident + 1
            self._put_define(ident, define)
            self._ids[who] = ident
        return ident

    def _fits(self, need: int) -> bool:
        """Whether ``need`` more slots are free: the writer's read index looked at only when the last
        look's room is used up, and the writer's life then (at most every 4096 records; while the ring
        is full, every 1024th refusal): a dead writer holds the ring up, so its successor is started,
        and goes on from its read index."""
        w = self._w
        if w + need <= self._limit:
            return True
        read = COUNTS.unpack_from(self._buf, 0)[0]
        if w - read + need > self.max_pending:
            self._limit = 0
            self._refused += 1
            if self._refused & 1023 == 1 and (self._proc is None or self._proc.poll() is not None):
                self._restart()
            return False
        if self._proc is None or self._proc.poll() is not None:
            self._restart()
        self._limit = min(read + self.max_pending, w + _CHECK_EVERY)
        return True

    def _put_define(self, ident: int, data: bytes) -> None:
        w, buf, mask = self._w, self._buf, self._mask
        for at in range(0, len(data), RID_MAX):
            last = at + RID_MAX >= len(data)
            _pack(buf, HEADER + ((w & mask) << 7), 0.0, 0.0, 0, 0, ident, DEFINE_END if last else DEFINE_MORE,
                  data[at:at + RID_MAX], w + 1)
            w += 1
        self._w = w

    # --- the writer process --------------------------------------------------------------------------

    def _start_writer(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, env.get("PYTHONPATH", "")) if p)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "azulite.serve.audit_writer", *self._args],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
                                    pass_fds=(self._fd,))
        except (OSError, ValueError, TypeError):  # no interpreter to run (sys.executable unknown), no fds
            self._proc = None  # records wait in the ring (then are dropped, counted) until a start succeeds
            return
        known = marshal.dumps(({ident: who for who, ident in self._ids.items()}, self.seal))
        try:  # the ids a predecessor was told of: records still in the ring may use them
            proc.stdin.write(FRAME.pack(len(known)) + known)
            proc.stdin.flush()
        except OSError:
            pass  # it died at once: seen at the next look
        self._proc = proc

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
            proc.wait(timeout_s)  # it reads the ring to its end, writes it, then exits on the closed pipe
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _restart(self) -> None:
        """From the request path: never waits for a flush or close in progress (they start one too)."""
        if not self._ctl.acquire(blocking=False):
            return
        try:
            if self._proc is None or self._proc.poll() is not None:
                self._stop_writer(0.0)
                self._start_writer()
        finally:
            self._ctl.release()

    def _ask(self, timeout_s: float) -> bool:
        """One round trip: the writer has read and written everything packed before it."""
        proc = self._proc
        if proc is None:
            return False
        try:
            proc.stdin.write(b"F")
            proc.stdin.flush()
            fd = proc.stdout.fileno()
            if not select.select([fd], [], [], timeout_s)[0]:
                return False
            return os.read(fd, 1) == b"A"
        except (OSError, ValueError):
            return False

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every line recorded before this call is written (or failed)."""
        with self._ctl:
            if self._buf is None:
                return True
            for _ in range(2):
                if self._proc is None or self._proc.poll() is not None:
                    self._stop_writer(0.0)
                    self._start_writer()
                if self._ask(timeout_s):
                    return True
            return False

    # --- counts --------------------------------------------------------------------------------------

    def _counts(self) -> tuple[int, int, int]:
        final = self._final
        if final is not None:
            return final
        try:
            return COUNTS.unpack_from(self._buf, 0)
        except (TypeError, ValueError):  # closed in between
            return self._final or (0, 0, 0)

    @property
    def written(self) -> int:
        return self._counts()[1]

    @property
    def write_errors(self) -> int:
        return self._counts()[2] + self._lost

    def close(self, timeout_s: float = 30.0) -> None:
        atexit.unregister(self.close)
        with self._ctl:
            if self._buf is None:
                return
            if self._proc is None or self._proc.poll() is not None:
                self._stop_writer(0.0)
                self._start_writer()  # a writer to read what is still in the ring
            self._stop_writer(timeout_s)
            self._final = COUNTS.unpack_from(self._buf, 0)
            self._limit = 0  # a record from here on is dropped (counted), not packed
            buf, self._buf = self._buf, None
            buf.close()
            os.close(self._fd)
