"""Bringing a checkpoint's files into the page cache ahead of the reader that verifies and loads them
(:mod:`azulite.train.reader`): one sequential stream per rank, in the order the files are read, that the
readers wait on, so that with the page cache cold the disk sees large sequential requests and the readers'
copies and hashes never wait on a device request of their own.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: how far the prefetch (:class:`Prefetch`) runs ahead of what this rank's reader threads consumed:
#: enough to keep the disk busy while a record is copied and hashed, bounded so that a checkpoint larger
#: than the page cache does not evict its own front before it is read (0: no prefetch)
PREFETCH_AHEAD = 1 << 30
#: the prefetch's unit: what a reader waits for before reading it from the cache
PREFETCH_CHUNK = 8 << 20
#: sequential streams a rank's prefetch reads at once. One per rank: two cost more CPU for no clear gain
#: here (0.24 vs 0.25-0.36 CPU-s a cold 302 MB restore, both ranks, under load 8-11). Every rank of a DDP
#: restore streams the same files in the same order, so the disk brings each page once (for whichever
#: rank asks first) and every rank's readers follow it at the disk's pace; starting ranks on different
#: files (a rotation by rank, tried) streamed as fast but left each rank's readers the other ranks' files
#: to copy at the end: 1,154-1,208 vs 1,197-1,284 MB/s (interleaved, load 3.5-8)
PREFETCH_STREAMS = 1


class Prefetch:
    """Brings files into the page cache ahead of this rank's readers: ``streams`` threads, each taking the
    next file in order and reading it front to back, :data:`PREFETCH_CHUNK` at a time, at most
    :data:`PREFETCH_AHEAD` bytes beyond what the readers consumed. The readers wait (:meth:`ready`) until
    what they are about to read is in the cache, so the disk sees these streams alone, in file order, and
    the readers' copies and hashes never wait on a device request of their own.

    A piece is read with ``sendfile`` to ``/dev/null``: an ordinary sequential read, so the kernel's
    readahead fetches it in large requests (large folios: 4 MiB requests on this machine's virtio disk,
    its max_sectors_kb), and nothing is copied out to user memory. ``POSIX_FADV_WILLNEED``, used before,
    fills the cache a page at a time, which caps a request at the queue's segment count (254 pages, ~1
    MiB): a cold 302 MB restore cost 150-330 device requests against torch.load's 80-115, and ran at
    0.70-0.77x its speed. WILLNEED remains the fallback where ``sendfile`` cannot write to /dev/null.
    Advice only either way: a file that is missing or shorter than expected fails where it is read,
    with its name (a stream that fails lets the readers go on reading that file themselves)."""

    def __init__(self, paths: list[Path], streams: int = 1) -> None:
        self.paths = paths
        self._known = set(paths)
        self._cond = threading.Condition()
        self._consumed = 0
        self._streamed = 0
        self._next = 0
        #: bytes of each file known to be in the cache (``_WHOLE`` once its stream ended, however it ended)
        self._cached: dict[Path, int] = {}
        self._blocked = 0  # streams waiting for the readers to consume
        self._stopped = False
        self._sendfile = hasattr(os, "sendfile")
        #: set once a stream stopped to let the readers catch up (PREFETCH_AHEAD reached)
        self.waited = threading.Event()
        #: set once the first file's first read was asked of the disk (or a stream ended before)
        self.issued = threading.Event()
        #: when the disk was asked for the first bytes (``time.perf_counter()``); None while it was not
        self.issued_at: float | None = None
        #: when the last stream ended, having asked the disk for something (the disk's last byte of a cold
        #: read that ran to its end); None while one runs
        self.ended_at: float | None = None
        usable = self._sendfile or hasattr(os, "posix_fadvise")
        self._threads = [threading.Thread(target=self._run, name="azulite-prefetch", daemon=True)
                         for _ in range(min(max(1, streams), len(paths)) if usable else 0)]
        self._live = len(self._threads)
        if not self._threads:
            self.issued.set()
        for t in self._threads:
            t.start()

    def consumed(self, n: int) -> None:
        with self._cond:
            self._consumed += n
            self._cond.notify_all()

    def ready(self, path: Path, end: int) -> None:
        """Returns once bytes [0, end) of ``path`` are in the cache, or its stream ended, or no stream can
        go on before the readers consume more (then the reader reads from the disk itself)."""
        if path not in self._known:
            return
        with self._cond:
            while (not self._stopped and self._live and self._cached.get(path, 0) < end
                   and self._blocked < self._live):
                self._cond.wait()

    def wait_issued(self, timeout: float = 1.0) -> None:
        """Returns once the disk was asked for the first bytes (at most ``timeout`` seconds). A caller that
        goes on running Python right after starting the prefetch (DCP's planning) would otherwise hold
        the GIL and keep the new thread from its first read for up to the interpreter's switch interval
        (5 ms): that long the disk idled."""
        self.issued.wait(timeout)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for t in self._threads:
            if t.is_alive():
                t.join()

    def _run(self) -> None:
        try:
            with open(os.devnull, "wb", buffering=0) as sink:
                while True:
                    with self._cond:
                        if self._stopped or self._next >= len(self.paths):
                            return
                        path = self.paths[self._next]
                        self._next += 1
                    try:
                        self._stream(path, sink.fileno())
                    finally:
                        with self._cond:
                            self._cached[path] = _WHOLE
                            self._cond.notify_all()
        finally:
            self.issued.set()
            with self._cond:
                self._live -= 1
                if not self._live and self.issued_at is not None:
                    self.ended_at = time.perf_counter()
                self._cond.notify_all()

    def _stream(self, path: Path, sink: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            size = os.fstat(fd).st_size
            # a file wholly in the cache (a warm restore) is not read again; one that is not is read whole:
            # skipping its cached pieces would break the sequential pattern the kernel's readahead keys on
            # (a cold restore then cost 170 device requests instead of 100)
            if in_cache(fd, 0, size):
                return
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # the largest readahead window
            at = 0
            while at < size:
                with self._cond:
                    while not self._stopped and self._streamed - self._consumed >= PREFETCH_AHEAD:
                        self._blocked += 1
                        self.waited.set()
                        self._cond.notify_all()  # readers waiting on a blocked stream read for themselves
                        self._cond.wait()
                        self._blocked -= 1
                    if self._stopped:
                        return
                    n = min(PREFETCH_CHUNK, size - at)
                    self._streamed += n
                if not self._bring(fd, sink, at, n):
                    return
                at += n
                with self._cond:
                    self._cached[path] = at
                    self._cond.notify_all()
        except OSError:
            return
        finally:
            os.close(fd)

    def _bring(self, fd: int, sink: int, at: int, n: int) -> bool:
        """Bytes [at, at + n) of ``fd`` into the cache; False when the file ended early."""
        end = at + n
        if self.issued_at is None:
            self.issued_at = time.perf_counter()
            self.issued.set()  # the system call below releases the GIL
        if self._sendfile:
            try:
                while at < end:
                    sent = os.sendfile(sink, fd, at, end - at)
                    if sent <= 0:
                        return False
                    at += sent
                return True
            except OSError as e:
                if e.errno not in _NO_SENDFILE:
                    raise
                self._sendfile = False  # not to /dev/null on this system: advice instead
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, at, end - at, os.POSIX_FADV_WILLNEED)
        return True


class _CacheRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


#: cachestat(2)'s number (Linux >= 6.5; one number on every architecture), None once it proved missing
_CACHESTAT: int | None = 451 if sys.platform.startswith("linux") else None
_PAGE = mmap.PAGESIZE


def in_cache(fd: int, at: int, n: int) -> bool:
    """Whether every page of bytes [at, at + n) of ``fd`` is in the page cache (cachestat(2)); False where
    that cannot be told. Passing over cached pages with sendfile costs ~7 ms of CPU per 302 MB a rank
    (~45 GB/s): a warm restore's whole prefetch, which this makes a few system calls."""
    global _CACHESTAT
    if _CACHESTAT is None or n <= 0:
        return False
    rng, stat = _CacheRange(at, n), _CacheStat()
    if _libc().syscall(_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(stat), 0) != 0:
        if ctypes.get_errno() == errno.ENOSYS:
            _CACHESTAT = None
        return False
    return stat.nr_cache >= (at + n + _PAGE - 1) // _PAGE - at // _PAGE


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


#: sendfile's answers where it cannot write to a file (macOS: sockets only)
_NO_SENDFILE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSOCK, errno.EOPNOTSUPP}
#: a file's cached bytes once its stream ended
_WHOLE = 1 << 62
