"""One truth across the worker processes of one server (``ServerSettings.shared_state_dir``): the rate
buckets, daily quotas and drift windows live in small memory-mapped files of that directory, each
update under an exclusive ``flock`` of its file, so a limit of R requests/s is R for all the workers
together and the drift windows hold every worker's answers.

Why mmap + flock, not SQLite (the key store's choice): an update is a read-modify-write of four floats;
under SQLite WAL with ``synchronous=OFF`` it measured 31.6 µs a take (a write transaction), here 5.4 µs
(two flock syscalls and a struct unpack/pack), in this process's dicts 0.6 µs (bench/shared_state.py,
load average 4.4: one worker keeps the dicts). Nothing is fsynced on the request path: the kernel's page cache holds the pages, so
a worker that dies or restarts loses nothing (the pages are the file's), only a machine crash may lose the
last seconds of counts. ``flock`` is released by the kernel when a holder dies, so a crashed worker
cannot wedge the others (a lock inside the mapping could). Keys and revocations are not here: they are in
the key store's SQLite file, which every worker already reads (serve/keystore.py).

The table of limits is fixed-size open addressing: a name's 16-byte blake2b digest, its home slot from
the digest, at most ``PROBE`` slots probed; a full window evicts its stalest slot (this only happens with
tens of thousands of live keys and models: the table holds 65,536).
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import mmap
import os
import struct
import threading
from pathlib import Path

import numpy as np

from azulite.errors import SpecError

LIMITS_FILE = "limits.bin"
DRIFT_DIR = "drift"
_MAGIC = b"AZLIMIT1"
_HEADER = struct.Struct("<8sII")  # magic, slot count, slot size
_HEADER_BYTES = 64
_SLOT_BYTES = 64
_KEY = 16
_VALUES = struct.Struct("<dddd")  # bucket: rate, burst, tokens, stamp; quota: day, used, -, wall time
_EMPTY = bytes(_KEY)
PROBE = 32
#: a stamp further ahead of the clock than this means the clock restarted (a reboot resets the monotonic
#: clock the buckets run on): the bucket starts afresh rather than waiting for the clock to catch up
_CLOCK_RESTARTED_S = 60.0


def _open(path: Path, what: str) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SpecError(f"cannot open the shared {what} file {path}: {exc.strerror}", field="shared_state_dir",
                        fix="give the server's workers a writable directory of their own") from None


class _Locked:
    """An exclusive flock on ``fd`` (other processes), plus a thread lock when ``thread_safe`` (flock does
    not exclude threads sharing the descriptor)."""

    __slots__ = ("fd", "tlock")

    def __init__(self, fd: int, thread_safe: bool) -> None:
        self.fd = fd
        self.tlock = threading.Lock() if thread_safe else None

    def __enter__(self) -> None:
        if self.tlock is not None:
            self.tlock.acquire()
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        if self.tlock is not None:
            self.tlock.release()


class SlotTable:
    """The shared file of buckets and quotas: ``slots`` slots of (digest, four floats)."""

    def __init__(self, path: Path, *, slots: int = 1 << 16, thread_safe: bool = False) -> None:
        self.path = Path(path)
        self.fd = _open(self.path, "rate-limit")
        self.lock = _Locked(self.fd, thread_safe)
        with self.lock:  # the first process to get here sizes the file; the others read its header
            size = os.fstat(self.fd).st_size
            if size == 0:
                os.ftruncate(self.fd, _HEADER_BYTES + slots * _SLOT_BYTES)
                os.pwrite(self.fd, _HEADER.pack(_MAGIC, slots, _SLOT_BYTES), 0)
            else:
                head = os.pread(self.fd, _HEADER.size, 0)
                magic, slots, slot_bytes = _HEADER.unpack(head) if len(head) == _HEADER.size else (b"", 0, 0)
                if (magic != _MAGIC or slot_bytes != _SLOT_BYTES or not slots
                        or size != _HEADER_BYTES + slots * _SLOT_BYTES):
                    raise SpecError(f"{self.path} is not an azulite shared rate-limit file (or is damaged)",
                                    field="shared_state_dir",
                                    fix="stop the server and remove the file (its counts start afresh)")
        self.slots = slots
        self.mm = mmap.mmap(self.fd, _HEADER_BYTES + slots * _SLOT_BYTES)
        self._where: dict[str, tuple[bytes, int]] = {}  # name -> (digest, offset): found once, then checked

    def find(self, name: str) -> int | None:
        """The offset of ``name``'s slot, or None when it has none (nothing is made). Call under ``lock``."""
        digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=_KEY).digest()
        home = int.from_bytes(digest[:8], "little") % self.slots
        mm = self.mm
        for i in range(min(PROBE, self.slots)):
            off = _HEADER_BYTES + ((home + i) % self.slots) * _SLOT_BYTES
            key = mm[off:off + _KEY]
            if key == digest:
                return off
            if key == _EMPTY:
                return None
        return None

    def slot(self, name: str) -> tuple[int, bool]:
        """The offset of ``name``'s slot and whether it is new (zeroed values). Call under ``lock``."""
        mm = self.mm
        hit = self._where.get(name)
        if hit is not None and mm[hit[1]:hit[1] + _KEY] == hit[0]:
            return hit[1], False
        digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=_KEY).digest()
        home = int.from_bytes(digest[:8], "little") % self.slots
        stalest, stalest_stamp = -1, math.inf
        for i in range(min(PROBE, self.slots)):
            off = _HEADER_BYTES + ((home + i) % self.slots) * _SLOT_BYTES
            key = mm[off:off + _KEY]
            if key == digest:
                new = False
                break
            if key == _EMPTY:
                new = True
                break
            stamp = _VALUES.unpack_from(mm, off + _KEY)[3]
            if stamp < stalest_stamp:
                stalest, stalest_stamp = off, stamp
        else:
            off, new = stalest, True
        if new:
            mm[off:off + _SLOT_BYTES] = digest + bytes(_SLOT_BYTES - _KEY)
        if len(self._where) >= 4096:
            self._where.clear()
        self._where[name] = (digest, off)
        return off, new

    def close(self) -> None:
        try:
            self.mm.close()
        finally:
            os.close(self.fd)


class SharedTokenBuckets:
    """TokenBuckets (serve/ratelimit.py) held in a SlotTable: same ``take``, same answers."""

    def __init__(self, table: SlotTable, prefix: str, clock) -> None:
        self.table, self.prefix, self.clock = table, prefix, clock

    def take(self, name: str, rate: float, burst: float | None = None, now: float | None = None) -> float:
        if now is None:
            now = self.clock.monotonic()
        with self.table.lock:
            return self.take_locked(name, rate, burst, now)

    def take_locked(self, name: str, rate: float, burst: float | None, now: float) -> float:
        """``take`` for a caller already holding ``table.lock`` (the guard takes a request's key bucket,
        quota and model bucket under one lock: one flock pair a request, not three)."""
        table = self.table
        off, new = table.slot(self.prefix + name)
        at = off + _KEY
        r, size, tokens, stamp = _VALUES.unpack_from(table.mm, at)
        if new or r != rate:
            size = burst if burst is not None else max(1.0, rate)
            tokens, stamp = size, now
        elif now > stamp:
            tokens = min(size, tokens + (now - stamp) * rate)
            stamp = now
        elif stamp - now > _CLOCK_RESTARTED_S:
            stamp = now
        if tokens >= 1.0:
            _VALUES.pack_into(table.mm, at, rate, size, tokens - 1.0, stamp)
            return 0.0
        _VALUES.pack_into(table.mm, at, rate, size, tokens, stamp)
        return (1.0 - tokens) / rate


class SharedDailyQuotas:
    """DailyQuotas (serve/ratelimit.py) held in a SlotTable: requests per name per UTC day."""

    def __init__(self, table: SlotTable, prefix: str, clock) -> None:
        self.table, self.prefix, self.clock = table, prefix, clock

    def take(self, name: str, per_day: int, now: float | None = None) -> float:
        if now is None:
            now = self.clock.time()
        with self.table.lock:
            return self.take_locked(name, per_day, now)

    def take_locked(self, name: str, per_day: int, now: float) -> float:
        """``take`` for a caller already holding ``table.lock``."""
        day = int(now // 86400)
        table = self.table
        off, new = table.slot(self.prefix + name)
        at = off + _KEY
        used_day, used, _, _ = _VALUES.unpack_from(table.mm, at)
        if new or int(used_day) != day:
            used = 0.0
        if used >= per_day:
            return (day + 1) * 86400 - now
        _VALUES.pack_into(table.mm, at, float(day), used + 1.0, 0.0, now)
        return 0.0

    def read(self, name: str) -> tuple[int, int]:
        """(day, requests used that day) of ``name``'s counter ((-1, 0) if none; none is made). From another
        thread than the takes', through a SlotTable of its own (its own open file, so its flock excludes
        theirs: one description's lock does not exclude the threads sharing it)."""
        with self.table.lock:
            off = self.table.find(self.prefix + name)
            if off is None:
                return -1, 0
            used_day, used, _, _ = _VALUES.unpack_from(self.table.mm, off + _KEY)
        return int(used_day), int(used)

    def seed(self, name: str, day: int, used: int) -> None:
        """At least ``used`` requests of ``day`` counted for ``name`` (a restart's ledger)."""
        with self.table.lock:
            off, new = self.table.slot(self.prefix + name)
            at = off + _KEY
            used_day, count, _, stamp = _VALUES.unpack_from(self.table.mm, at)
            if new or int(used_day) != day:
                count = 0.0
            if count < used:  # stamped with the day's start at least: not the stalest slot to reuse
                _VALUES.pack_into(self.table.mm, at, float(day), float(used), 0.0, max(stamp, day * 86400.0))


# --- drift windows ----------------------------------------------------------------------------------

_DRIFT_MAGIC = b"AZDRIFT1"
_DRIFT_HEADER = struct.Struct("<8sQ")  # magic, window
_DRIFT_META = 16  # int64 [filled, pos, count] at this offset
_DRIFT_DATA = 64  # reference float64[window], then the ring float64[window]


def drift_key(model: str, config_bytes: bytes) -> str:
    """One folder per model and config: a model loaded with another config starts new windows (as a
    reload does in one process), the same config in every worker shares them."""
    return hashlib.sha256(model.encode() + b"\0" + config_bytes).hexdigest()[:24]


class SharedWindowFile:
    """One output's drift windows in a file: ``meta`` (filled, pos, count), ``reference`` and ``ring``
    are numpy views of the mapping, so drift.py's series code runs on them unchanged, under ``lock``."""

    def __init__(self, path: Path, window: int, *, thread_safe: bool = True) -> None:
        self.path = Path(path)
        fd = _open(self.path, "drift window")
        self.lock = _Locked(fd, thread_safe)
        size = _DRIFT_DATA + 16 * window
        with self.lock:
            have = os.fstat(fd).st_size
            head = os.pread(fd, _DRIFT_HEADER.size, 0) if have else b""
            if have != size or head != _DRIFT_HEADER.pack(_DRIFT_MAGIC, window):  # new (or not ours): start it
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)
                os.pwrite(fd, _DRIFT_HEADER.pack(_DRIFT_MAGIC, window), 0)
        self.mm = mmap.mmap(fd, size)
        self.meta = np.frombuffer(self.mm, dtype=np.int64, count=3, offset=_DRIFT_META)
        self.reference = np.frombuffer(self.mm, dtype=np.float64, count=window, offset=_DRIFT_DATA)
        self.ring = np.frombuffer(self.mm, dtype=np.float64, count=window, offset=_DRIFT_DATA + 8 * window)


class SharedDriftStore:
    """The drift windows of one model (one config) in ``DIR/drift/<key>/<output name, hex>.bin``."""

    def __init__(self, root: Path, key: str) -> None:
        self.folder = Path(root) / DRIFT_DIR / key

    def open(self, output: str, window: int) -> SharedWindowFile:
        return SharedWindowFile(self.folder / f"{output.encode().hex()}.bin", window)

    def outputs(self) -> list[str]:
        """The outputs some worker has windows for (a worker that has not answered one yet still reports it)."""
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            if n.endswith(".bin"):
                try:
                    out.append(bytes.fromhex(n[:-4]).decode())
                except ValueError:
                    continue
        return sorted(out)
