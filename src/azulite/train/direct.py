"""Reading a checkpoint file that is not in the page cache with ``O_DIRECT``: the disk's DMA lands in a
page-aligned buffer of ours, never in the page cache, so a cold read costs no page-cache allocation,
readahead bookkeeping or eviction, and several large requests are in flight at once.

:class:`DirectStream` reads one file front to back: :data:`DEPTH` requests of :data:`CHUNK` bytes in flight
(each into its own slot of one anonymous mmap, reused as the reader consumes), handed out in order by
:meth:`DirectStream.readinto` (a copy that releases the GIL) and :meth:`DirectStream.peek` (bytes ahead of
the reader: a record's layout). Nothing here checks a byte: the caller hashes everything it takes, as it
does with buffered reads. Where ``O_DIRECT`` is refused (the open or the first read answers EINVAL: some
file systems) :func:`open_stream` answers None and the caller reads buffered.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

#: whether a cold file (not wholly in the page cache) is read with O_DIRECT at all
ENABLED = True
#: bytes per request: the buffer address, the file offset and the length are multiples of the page, which
#: satisfies any logical block size up to 4096 (512 on this machine's virtio disk)
CHUNK = 8 << 20
#: requests in flight per file
DEPTH = 4
_ALIGN = mmap.PAGESIZE
#: what the kernel answers where a file system or device takes no O_DIRECT
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP}


class DirectStream:
    """One file, read front to back with O_DIRECT, :data:`DEPTH` chunks ahead of the consumer."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd, self.size = fd, size
        self._chunks = (size + CHUNK - 1) // CHUNK
        self._depth = DEPTH
        self._area = _take_area(self._depth * CHUNK)
        self._view, self._base = self._area.view, self._area.base
        self._pool = ThreadPoolExecutor(max_workers=self._depth, thread_name_prefix="azulite-direct")
        self._pending: dict[int, Future[int]] = {}
        self.pos = 0  # the next byte readinto hands out
        for k in range(self._depth):
            self._submit(k)

    def _submit(self, k: int) -> None:
        if k < self._chunks:
            self._pending[k] = self._pool.submit(self._read_chunk, k)

    def _read_chunk(self, k: int) -> int:
        at = k * CHUNK
        want = min(CHUNK, self.size - at)
        slot = (k % self._depth) * CHUNK
        aligned = (want + _ALIGN - 1) // _ALIGN * _ALIGN
        done = 0
        while done < want:  # a short read before the end (rare): the rest, from an aligned offset on
            n = os.preadv(self._fd, [self._view[slot + done : slot + aligned]], at + done)
            if n <= 0:
                break
            done += n
            if done < want and done % _ALIGN:
                break  # an unaligned short read is the file's end
        return done

    def _chunk(self, k: int) -> int:
        """Bytes of chunk ``k`` in its slot (waits for its read)."""
        return self._pending[k].result()

    def first_ok(self) -> bool:
        """Whether the first request was taken (False: the file system refused O_DIRECT reads)."""
        if not self._chunks:
            return True
        try:
            self._chunk(0)
        except OSError as e:
            if e.errno in _REFUSED:
                return False
            raise
        return True

    def peek(self, at: int, n: int) -> bytes | None:
        """Bytes [at, at + n) when they lie within the chunks in flight (at or after the consumer), else
        None (the caller reads them some other way)."""
        first, last = at // CHUNK, (at + n - 1) // CHUNK
        if n <= 0 or at < self.pos or first not in self._pending or last not in self._pending:
            return None
        out = bytearray()
        for k in range(first, last + 1):
            got = self._chunk(k)
            lo = max(at, k * CHUNK) - k * CHUNK
            hi = min(at + n, k * CHUNK + got) - k * CHUNK
            if hi <= lo:
                break
            slot = (k % self._depth) * CHUNK
            out += self._view[slot + lo : slot + hi]
        return bytes(out)

    def readinto(self, dest: memoryview) -> int:
        """Copies the next bytes into ``dest`` (at most to the end of the current chunk); 0 at the end."""
        if self.pos >= self.size:
            return 0
        k = self.pos // CHUNK
        got = self._chunk(k)
        lo = self.pos - k * CHUNK
        n = min(len(dest), got - lo)
        if n <= 0:
            return 0
        src = self._base + (k % self._depth) * CHUNK + lo
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(dest)), src, n)  # releases the GIL
        self.pos += n
        if self.pos >= (k + 1) * CHUNK or self.pos >= self.size:
            del self._pending[k]
            self._submit(k + self._depth)
        return n

    def close(self) -> None:
        for fut in self._pending.values():
            fut.cancel()
        self._pool.shutdown(wait=True)
        self._pending.clear()
        _give_back(self._area)
        os.close(self._fd)


class _Area:
    """:data:`DEPTH` slots of :data:`CHUNK` bytes: one anonymous mmap aligned to 2 MiB and backed by huge pages
    where the kernel gives them (madvise): each request then is a few physically contiguous segments, so
    the device takes it in its largest requests (4 KiB pages cap a request at the queue's 254 segments,
    ~1 MiB), and touching it the first time costs 1/512th of the page faults. Kept for the next file."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.map = mmap.mmap(-1, size + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._anchor = ctypes.c_char.from_buffer(self.map)
        start = -ctypes.addressof(self._anchor) % _HUGE
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.map.madvise(mmap.MADV_HUGEPAGE, start, size)
        self.view = memoryview(self.map)[start : start + size]
        self.base = ctypes.addressof(self._anchor) + start

    def close(self) -> None:
        self.view.release()
        del self._anchor
        self.map.close()


_HUGE = 2 << 20
_areas: list[_Area] = []
_areas_lock = threading.Lock()


def _take_area(size: int) -> _Area:
    with _areas_lock:
        for i, area in enumerate(_areas):
            if area.size == size:
                return _areas.pop(i)
    return _Area(size)


def _give_back(area: _Area) -> None:
    with _areas_lock:
        _areas.append(area)


def release_areas() -> None:
    """Unmaps the buffers kept for the next file (a restore's end)."""
    with _areas_lock:
        while _areas:
            _areas.pop().close()


def open_stream(path: Path, size: int, check: bool = True) -> DirectStream | None:
    """``path`` read with O_DIRECT from its start, or None where that is refused (or disabled). With
    ``check`` False the first request is not waited for: the caller asks :meth:`DirectStream.first_ok`."""
    if not ENABLED or not hasattr(os, "O_DIRECT"):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno in _REFUSED:
            return None
        raise
    stream = DirectStream(fd, size)
    if check and not stream.first_ok():
        stream.close()
        return None
    return stream
