"""The audit log's writer process: it turns the server's batches of raw request records into JSON lines,
rotates the file by size and writes it, so that none of this runs under the server's GIL.

Why a process and not a thread: a thread formatting and writing ~2 µs a line takes that time from the
event loop (one GIL), the guarded request's largest cost after its checks. The server's side
(serve/audit.py) hands a batch over as one ``marshal`` blob (C speed, ~0.1-0.2 µs a line) in one pipe
write and reads back one acknowledgement per batch: ``<QQ`` lines written, lines lost to a failed write.

Run as ``python -m azulite.serve.audit_writer PATH MAX_BYTES BACKUPS LOCK BOOT`` with the batches on
stdin (frames: ``<I`` length, then ``marshal.dumps((wall_offset, records))``) and the acknowledgements on
stdout. It ignores SIGINT and SIGTERM (a terminal's Ctrl-C or a signal to the whole process group must
not end it before the server has handed over its last lines) and exits when its stdin closes: the
server's close(), or the server's death, SIGKILL included. What it has received is then still written;
what the server had not yet handed over (at most one batch interval) is lost with the server.
"""

from __future__ import annotations

import fcntl
import json
import logging.handlers
import marshal
import os
import signal
import struct
import sys
from pathlib import Path

#: a line: time, request id, the cached middle (key ... status), latency, sizes
_TEMPLATE = '{"time":%.6f,"request_id":%s,%s"latency_ms":%.3f,"bytes_in":%d,"bytes_out":%d}'
_str = json.encoder.encode_basestring_ascii  # C: a JSON string literal, quotes included
FRAME = struct.Struct("<I")
ACK = struct.Struct("<QQ")


class Writer:
    """Formats, rotates and writes; counts what it wrote and what a failed write lost."""

    def __init__(self, path: str, max_bytes: int, backups: int, lock: str | None, boot: str) -> None:
        self.path = Path(path)
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
        self._handler = logging.handlers.RotatingFileHandler(str(self.path), maxBytes=max_bytes, backupCount=backups,
                                                             delay=True, encoding="utf-8")
        self._middles: dict[tuple, str] = {}  # (key, client, model, version, protocol, status) -> JSON
        self._next_id = 1
        # hex and digits: nothing to escape
        self._own_template = _TEMPLATE.replace('"request_id":%s', f'"request_id":"{boot}-%d"')

    def batch(self, offset: float, records: list) -> None:
        """``offset``: wall-clock time minus the server's perf_counter when the batch was handed over
        (records carry perf_counter times: the request path reads one clock, not two)."""
        lines = []
        line = self._line
        for item in records:
            try:
                lines.append(line(item, offset))
            except (TypeError, ValueError, IndexError):
                self.write_errors += 1
        if lines:
            self._write(lines)

    def _line(self, item: tuple, offset: float) -> str:
        """One JSON object by template: ~3x faster than json.dumps of a dict (strings still go through
        json's own C escaper, so a hostile model name or request id cannot break the line). The fields
        a client repeats request after request (key, address, model, version, protocol, status) are
        escaped once and kept (bounded); a server-assigned request id is a number in the template."""
        middle = self._middles.get(item[2:8])
        if middle is None:
            middle = self._middle(item[2:8])
        rid = item[1]
        if rid is None:
            n = self._next_id
            self._next_id = n + 1
            return self._own_template % (item[0] + offset, n, middle, item[8] * 1000.0, item[9], item[10])
        return _TEMPLATE % (item[0] + offset, _str(rid), middle, item[8] * 1000.0, item[9], item[10])

    def _middle(self, who: tuple) -> str:
        key, client, model, version, protocol, status = who
        if len(self._middles) >= 4096:
            self._middles.clear()
        middle = self._middles[who] = '"key_id":%s,"client":%s,"model":%s,"version":%s,"protocol":%s,"status":%s,' % (
            "null" if key is None else _str(key), _str(client), _str(model), _str(version), _str(protocol),
            status if isinstance(status, int) else _str(status))
        return middle

    def _write(self, lines: list[str]) -> None:
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

    def _append(self, lines: list[str]) -> None:
        """Append the lines, rotating (RotatingFileHandler's naming: audit.log.1, .2 ...) whenever the next
        line would take the file past max_bytes."""
        h = self._handler
        pending = lines
        try:
            if h.stream is None:
                h.stream = h._open()
            size = os.fstat(h.stream.fileno()).st_size  # the file's, other workers' lines included
            if h.maxBytes <= 0 or size + sum(map(len, pending)) + len(pending) <= h.maxBytes:
                h.stream.write("\n".join(pending) + "\n")  # no rotation due: one write, no per-line loop
                h.stream.flush()
                self.written += len(pending)
                return
            while pending:
                chunk, used = [], 0
                for line in pending:
                    n = len(line) + 1
                    if h.maxBytes > 0 and size + used + n > h.maxBytes and (size or chunk):
                        break
                    chunk.append(line)
                    used += n
                if chunk:
                    h.stream.write("\n".join(chunk) + "\n")
                    self.written += len(chunk)
                    pending = pending[len(chunk):]
                    size += used
                if pending:
                    h.stream.flush()
                    h.doRollover()
                    if h.stream is None:  # delay=True: doRollover leaves the new file unopened
                        h.stream = h._open()
                    size = 0
            h.stream.flush()
        except Exception:  # noqa: BLE001 - the writer must outlive any failure; counted
            self.write_errors += len(pending)
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
    path, max_bytes, backups, lock, boot = argv
    writer = Writer(path, int(max_bytes), int(backups), lock or None, boot)
    inp, out = sys.stdin.fileno(), sys.stdout.fileno()
    try:
        while True:
            head = read_exactly(inp, FRAME.size)
            if not head:
                break  # the server closed the log, or died
            blob = read_exactly(inp, FRAME.unpack(head)[0])
            if not blob:
                break
            written, errors = writer.written, writer.write_errors
            try:
                offset, records = marshal.loads(blob)
                writer.batch(offset, records)
            except (ValueError, EOFError, TypeError):
                pass  # not ours: nothing to count it in
            try:
                os.write(out, ACK.pack(writer.written - written, writer.write_errors - errors))
            except OSError:
                pass  # the server is gone: keep writing what is still in the pipe
    finally:
        writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
