"""The audit log's writer process: it reads the server's raw request records from a shared-memory ring
(serve/audit.py packs them), turns them into JSON lines, rotates the file by size and writes it, so that
none of this runs under the server's GIL or on its cores' request path.

Why a process and not a thread: a thread formatting and writing ~2 µs a line takes that time from the
event loop (one GIL), and even a thread that only hands batches over wakes beside the loop and contends
for the GIL (measured at stop 23: half of the guard's cost). The server does no I/O per record and runs no
thread: it packs one record into the ring (one ``struct.pack_into``); this process reads the ring on its
own timer (every ``batch_s``), and at once when the server asks (flush, close).

The ring (:data:`HEADER` bytes, then fixed :data:`SLOT` slots, a power of two of them): the header holds
what this process writes (how far it read, lines written, lines lost to a failed write); slot ``i % n``
holds record ``i`` with ``i + 1`` in its last 8 bytes, written last (``pack_into`` stores the fields in
order, and x86-64 keeps stores in order), so a slot whose sequence is not the one expected is not yet
(fully) written and the reading stops there. The server never writes a slot this process has not read
(it compares with the header's read index). The fields a client repeats request after request (key,
address, model, version, protocol, status) travel once, as a "define" of a small id spread over as many
slots as it needs; a record carries the id. A request id longer than :data:`RID_MAX` bytes is cut, and
the line says so.

Sealed logs (``--audit-seal``, ``--audit-key``): every write (a batch, or its part in one file when the file
rotates within it) ends with a seal line, ``{"time":...,"audit_seal":{"alg":...,"lines":N,"prev":P,
"hash":H}}``, H the SHA-256 (HMAC-SHA256 with a key) of P, a newline and the N lines before it with their
newlines; P is the seal before it: kept in memory by a log's only writer, read from the log's last line
at a writer's first write and, where several writers share the log, before each write under the lock (so a
restarted writer and every worker's writer continue one chain, across rotated files); "" starts a chain. A line changed,
removed or added, and a seal removed, then break the chain (serve/audit_verify.py finds where); with a key,
no one without it can write a chain that holds.

Run as ``python -m azulite.serve.audit_writer PATH MAX_BYTES BACKUPS LOCK BOOT RING_FD BATCH_S`` with the
ring's file descriptor inherited. Its stdin is the server's: a byte ``F`` asks for a read now, answered
with one byte ``A`` on stdout once every record written before it is in the file (or counted lost). It
starts by reading, as ``<I`` length then ``marshal``, the ids (define id -> fields) the server has already
defined, which a predecessor that died may have read from the ring and taken with it, and the seal's key
(None: no seals; b"": SHA-256; the key otherwise: never in argv, where any local user reads it). It
ignores SIGINT and SIGTERM (a signal to the whole process group must not end it before the server has
closed) and exits when its stdin closes — the server's close(), or the server's death, SIGKILL included —
after reading the ring one last time: every record the server had packed is still written.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging.handlers
import marshal
import mmap
import os
import select
import signal
import struct
import sys
import time
from pathlib import Path

#: time (perf_counter), latency (s), bytes in, bytes out, define id, kind, request id (or a define's
#: bytes), sequence: 128 bytes
SLOT = struct.Struct("<ddqqIB83pQ")
SEQ = struct.Struct("<Q")
SEQ_AT = SLOT.size - SEQ.size
#: read index, lines written, lines lost to a failed write (this process writes them)
COUNTS = struct.Struct("<QQQ")
HEADER = 128
FRAME = struct.Struct("<I")
RID_MAX = 82  # what the "83p" field holds
#: slot kinds
NO_RID, RID, RID_CUT, DEFINE_MORE, DEFINE_END = range(5)
CUT_MARK = "...(truncated)"
assert SLOT.size == 128 and SEQ_AT % 8 == 0

#: a line: time, request id, the cached middle (key ... status), latency, sizes
#: bytes, written to the file's binary layer: ~25% cheaper than str formatting, and nothing to encode
_TEMPLATE = b'{"time":%.6f,"request_id":%s,%s"latency_ms":%.3f,"bytes_in":%d,"bytes_out":%d}'
_str = json.encoder.encode_basestring_ascii  # C: a JSON string literal, quotes included
#: a seal line, and the most bytes one takes (room kept for it below max_bytes; the tail read to find it)
_SEAL = b'{"time":%.6f,"audit_seal":{"alg":"%s","lines":%d,"prev":"%s","hash":"%s"}}\n'
SEAL_MAX = 256


def seal_hash(key: bytes | None, prev: str, body: bytes) -> str:
    """The hash a seal carries: of ``prev``, a newline and ``body`` (the lines it seals, each with its
    newline); HMAC-SHA256 under ``key`` when there is one."""
    h = hmac.new(key, digestmod=hashlib.sha256) if key else hashlib.sha256()
    h.update(prev.encode("ascii") + b"\n")
    h.update(body)
    return h.hexdigest()


def seal_of(line: bytes) -> dict | None:
    """A seal line's fields, or None for any other line."""
    if b'"audit_seal"' not in line:
        return None
    try:
        seal = json.loads(line).get("audit_seal")
    except (ValueError, AttributeError):
        return None
    return seal if isinstance(seal, dict) else None


def last_seal(path: Path | str) -> str | None:
    """The hash of the seal that ends the file: None when the file is missing or empty (the chain goes on
    from the file before it), "" when its last line is not a whole seal (a new chain starts: lines written
    without one, or a write cut short, then show as a break)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return None
            f.seek(max(0, size - SEAL_MAX))
            tail = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return ""
    if not tail.endswith(b"\n"):
        return ""
    seal = seal_of(tail[:-1].rsplit(b"\n", 1)[-1])
    hash_ = seal.get("hash") if seal is not None else None
    return hash_ if isinstance(hash_, str) else ""


class _PrivateRotatingFile(logging.handlers.RotatingFileHandler):
    """The standard rotation, each new file readable by its owner only (0600): the lines name clients'
    addresses and keys, which the umask (022) left readable by every local user."""

    def _open(self):
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return open(fd, self.mode, encoding=self.encoding, errors=self.errors)


class Writer:
    """Formats, rotates and writes; counts what it wrote and what a failed write lost."""

    def __init__(self, path: str, max_bytes: int, backups: int, lock: str | None, boot: str,
                 seal: bytes | None = None) -> None:
        """``seal``: None, no seal lines; b"", SHA-256 seals; a key, HMAC-SHA256 seals."""
        self.path = Path(path)
        self.seal = seal
        self._alg = b"hmac-sha256" if seal else b"sha256"
        self._prev: str | None = None  # the last seal's hash (None: read it from the log before the next write)
        self._lock_fd = None
        if lock:
            try:
                self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError:
                self._lock_fd = -1  # every batch then fails, counted
        self.written = 0
        self.write_errors = 0
        # delay=True: the file opens at the first line, so a missing folder later is a counted failure;
        # the standard library's rotation (renames, backup count); lines are written in batches below
        self._handler = _PrivateRotatingFile(str(self.path), maxBytes=max_bytes, backupCount=backups, delay=True,
                                             encoding="utf-8")
        self._middles: dict[int, bytes] = {}  # define id -> b'"key_id":...,"status":...,'
        self._define = bytearray()  # a define's bytes read so far (it may span slots)
        self._next_id = 1
        # hex and digits: nothing to escape
        self._own_template = _TEMPLATE.replace(b'"request_id":%s', f'"request_id":"{boot}-%d"'.encode("ascii"))

    # --- the ring ------------------------------------------------------------------------------------

    def attach(self, fd: int) -> None:
        self._map = mmap.mmap(fd, os.fstat(fd).st_size)
        self._mask = (len(self._map) - HEADER) // SLOT.size - 1
        self._read, self.written, self.write_errors = COUNTS.unpack_from(self._map, 0)  # a predecessor's

    def drain(self, now: float | None = None, offset: float | None = None) -> None:
        """Format and write every record packed so far, then publish how far this process read. ``now``
        (wall time) and ``offset`` (wall time less the server's perf_counter): read here unless given (tests)."""
        mask, r = self._mask, self._read
        if now is None:
            now = time.time()
        if offset is None:
            offset = now - time.perf_counter()  # the server's perf_counter is this clock (monotonic)
        # A line's time is "%.6f" of a wall-clock float near 1.8e9: 16 significant digits, dtoa's slow
        # path (~0.45 µs, a third of a line's cost). Within [base, base + 999) (base: now's multiple of
        # 1000 s) it is written as base's leading digits and "%010.6f" of wall - base, a small float:
        # the same digits (the subtraction is exact, base an integer: wall - base rounds as wall does),
        # ~0.15 µs less. A time outside (a line from before base, a clock step) takes the full format.
        base = float(int(now) // 1000 * 1000)
        top = base + 999.0
        if base < 1000.0:
            top = base  # no leading digits to write (a clock near the epoch): always the full format
        lines = []
        append = lines.append
        middles, own = self._middles, self._own_template
        lead = b"%d" % (int(base) // 1000)
        own_near = own.replace(b'"time":%.6f', b'"time":' + lead + b"%010.6f")
        rid_near = _TEMPLATE.replace(b'"time":%.6f', b'"time":' + lead + b"%010.6f")
        errors = 0
        next_id = self._next_id
        with memoryview(self._map) as view:
            while True:
                # the slots from r to the ring's end, unpacked lazily (one C iterator: no call per slot)
                start, wrapped = r & mask, True
                for t, latency, n_in, n_out, ident, kind, rid, seq in SLOT.iter_unpack(
                        view[HEADER + start * SLOT.size:]):
                    if seq != r + 1:  # not (fully) written yet: the end of what there is
                        wrapped = False
                        break
                    r += 1
                    if kind >= DEFINE_MORE:
                        self._define += rid
                        if kind == DEFINE_END:
                            self._defined(ident)
                        continue
                    middle = middles.get(ident)
                    if middle is None:  # a define that could not be read: the line is lost, counted
                        errors += 1
                        continue
                    wall = t + offset
                    if kind == NO_RID:
                        if base <= wall < top:
                            append(own_near % (wall - base, next_id, middle, latency * 1000.0, n_in, n_out))
                        else:
                            append(own % (wall, next_id, middle, latency * 1000.0, n_in, n_out))
                        next_id += 1
                    else:
                        text = rid.decode("utf-8", "replace")
                        if kind == RID_CUT:
                            text += CUT_MARK
                        rid_id = _str(text).encode("ascii")
                        if base <= wall < top:
                            append(rid_near % (wall - base, rid_id, middle, latency * 1000.0, n_in, n_out))
                        else:
                            append(_TEMPLATE % (wall, rid_id, middle, latency * 1000.0, n_in, n_out))
                if not wrapped or r & mask:  # stopped at an unwritten slot (or an empty ring)
                    break
        self._next_id = next_id
        self.write_errors += errors
        if lines:
            self._write(lines)
        self._read = r
        COUNTS.pack_into(self._map, 0, r, self.written, self.write_errors)

    def _defined(self, ident: int) -> None:
        data, self._define = bytes(self._define), bytearray()
        try:
            who = marshal.loads(data)
        except (ValueError, EOFError, TypeError):
            return
        if who is None:  # the server forgot its ids: no record read from here on uses an older one
            self._middles.clear()
            return
        self.define(ident, who)

    def define(self, ident: int, who: tuple) -> None:
        key, client, model, version, protocol, status = who
        middle = '"key_id":%s,"client":%s,"model":%s,"version":%s,"protocol":%s,"status":%s,' % (
            "null" if key is None else _str(key), _str(client), _str(model), _str(version), _str(protocol),
            status if type(status) is int else _str(str(status)))
        self._middles[ident] = middle.encode("ascii")  # escaped: ASCII only

    # --- the file ------------------------------------------------------------------------------------

    def _write(self, lines: list[bytes]) -> None:
        if self._lock_fd is None:
            self._append(lines)
            return
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        except (OSError, ValueError):
            self.write_errors += len(lines)
            return
        try:
            h = self._handler
            if h.stream is not None and not self._still_the_log(h.stream):
                h.stream.close()  # another worker rotated the log: append to the new file
                h.stream = None
            self._append(lines)
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _still_the_log(self, stream) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(stream.fileno()).st_ino
        except (OSError, ValueError):
            return False

    def _head(self) -> str:
        """The hash the next seal chains to: the last seal in the log (or in the file rotated last)."""
        head = last_seal(self.path)
        if head is None:
            head = last_seal(f"{self.path}.1")
        return head or ""

    def _put(self, out, body: bytes, lines: int) -> int:
        """Write ``body`` and, on a sealed log, the seal line that ends it (written after it, not joined
        to it: a batch is large, and a copy of it costs more than the buffered second write); the bytes."""
        out.write(body)
        if self.seal is None:
            return len(body)
        prev = self._prev or ""
        self._prev = seal_hash(self.seal, prev, body)
        seal = _SEAL % (time.time(), self._alg, lines, prev.encode("ascii"), self._prev.encode("ascii"))
        out.write(seal)
        return len(body) + len(seal)

    def _append(self, lines: list[bytes]) -> None:
        """Append the lines, rotating (RotatingFileHandler's naming: audit.log.1, .2 ...) whenever the next
        line would take the file past max_bytes."""
        h = self._handler
        pending = lines
        room = SEAL_MAX if self.seal is not None else 0  # each write's seal line fits in the file too
        try:
            if h.stream is None:
                h.stream = h._open()
            if self.seal is not None and (self._prev is None or self._lock_fd is not None):
                # this process's first write (a predecessor or an earlier server may have sealed the log), or a
                # log other workers' writers seal too (read under the lock); alone, it knows its last seal
                self._prev = self._head()
            size = os.fstat(h.stream.fileno()).st_size  # the file's, other workers' lines included
            if h.maxBytes <= 0 or size + sum(map(len, pending)) + len(pending) + room <= h.maxBytes:
                out = h.stream.buffer  # the lines are bytes: the text layer is never written to
                # no rotation due: one write, no per-line loop; the last newline joined in, not added to the
                # joined batch (a second copy of it: a batch of ~1,000 lines is past malloc's mmap threshold, and
                # the copy went to fresh pages: ~170 ns a line, against ~10 joined in)
                self._put(out, b"\n".join([*pending, b""]), len(pending))
                out.flush()
                self.written += len(pending)
                return
            while pending:
                chunk, used = [], 0
                for line in pending:
                    n = len(line) + 1
                    if h.maxBytes > 0 and size + used + n + room > h.maxBytes and (size or chunk):
                        break
                    chunk.append(line)
                    used += n
                if chunk:
                    size += self._put(h.stream.buffer, b"\n".join([*chunk, b""]), len(chunk))
                    self.written += len(chunk)
                    pending = pending[len(chunk):]
                if pending:
                    h.stream.buffer.flush()
                    h.doRollover()
                    if h.stream is None:  # delay=True: doRollover leaves the new file unopened
                        h.stream = h._open()
                    size = 0
            h.stream.buffer.flush()
        except Exception:  # noqa: BLE001 - the writer must outlive any failure; counted
            self.write_errors += len(pending)
            self._prev = None  # what reached the file is unknown: its last seal is read again
            try:
                if h.stream is not None:
                    h.stream.close()
            except OSError:
                pass
            h.stream = None  # reopen on the next batch (the disk may come back)

    def close(self) -> None:
        try:
            self._handler.close()
        except OSError:
            pass


def read_exactly(fd: int, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return b""
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    path, max_bytes, backups, lock, boot, ring_fd, batch_s = argv
    inp, out, period = sys.stdin.fileno(), sys.stdout.fileno(), float(batch_s)
    # first, the ids a predecessor had been told of (records still in the ring may use them), and the seal
    head = read_exactly(inp, FRAME.size)
    known = read_exactly(inp, FRAME.unpack(head)[0]) if head else b""
    try:
        ids, seal = marshal.loads(known) if known else ({}, None)
    except (ValueError, EOFError, TypeError):
        ids, seal = {}, None  # the lines that use them are counted lost; unsealed lines show when verified
    writer = Writer(path, int(max_bytes), int(backups), lock or None, boot, seal)
    writer.attach(int(ring_fd))
    for ident, who in ids.items():
        writer.define(ident, who)
    try:
        while True:
            ready = select.select([inp], [], [], period)[0]
            if not ready:
                writer.drain()  # the timer
                continue
            asked = os.read(inp, 4096)
            writer.drain()  # asked, or the server closed: either way every record packed so far
            if not asked:
                break  # the server closed the log, or died
            try:
                os.write(out, b"A" * asked.count(b"F"))
            except OSError:
                pass  # the server is gone: the EOF follows
    finally:
        writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
