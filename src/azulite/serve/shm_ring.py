"""Tensors between azulite's own processes (front-ends, the model host, instance processes) through
shared memory: an :class:`Arena` is an anonymous memfd mapped by both sides (its descriptor travels
over the Unix socket, so no name in /dev/shm can leak when a process dies), a first-fit allocator
hands out blocks, and :func:`put` / :func:`take` turn arrays into small descriptors and back.

Only descriptors (name, dtype, shape, offset) cross the socket; the bytes are written once into the
arena and read in place by the other side. A tensor that does not fit in the free space travels inline
after the frame's header instead (raw bytes, never pickled), so a full arena slows a request down but
never fails it.

Why not multiprocessing.shared_memory: it names its segments in /dev/shm and its resource tracker
unlinks them behind a second process's back; a memfd has neither problem.
"""

from __future__ import annotations

import bisect
import math
import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from azulite.serve.http_codec import deserialize_bytes, serialize_bytes

ALIGN = 64  # cache line: blocks never share one, and numpy gets aligned views
DEFAULT_ARENA_BYTES = 256 * 1024 * 1024  # reserved address space; pages cost memory only once touched


class Arena:
    """One shared block of memory and its allocator (used by exactly one side: the writer)."""

    def __init__(self, size: int = DEFAULT_ARENA_BYTES, *, fd: int | None = None) -> None:
        if fd is None:
            fd = os.memfd_create("azulite-tensors", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        else:
            size = os.fstat(fd).st_size
        self.fd = fd
        self.size = size
        self.map = mmap.mmap(fd, size)
        self.view = memoryview(self.map)
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, size), sorted by offset
        self._used: dict[int, int] = {}

    def alloc(self, n: int) -> int | None:
        """Offset of a block of at least n bytes, or None when no free block is that large."""
        n = max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)
        for i, (offset, size) in enumerate(self._free):
            if size >= n:
                if size == n:
                    del self._free[i]
                else:
                    self._free[i] = (offset + n, size - n)
                self._used[offset] = n
                return offset
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset, None)
        if size is None:
            return  # freed twice (a peer's release after a reset): nothing to do
        i = bisect.bisect_left(self._free, (offset, 0))
        if i < len(self._free) and offset + size == self._free[i][0]:  # merge with the next block
            size += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and with the previous
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (offset, size))

    def reset(self) -> None:
        """Everything free again (a writer whose reader is done with every block)."""
        self._free = [(0, self.size)]
        self._used.clear()

    @property
    def in_use(self) -> int:
        return sum(self._used.values())

    def close(self) -> None:
        self.view.release()
        try:
            self.map.close()
        except BufferError:  # an array still views the mapping: the OS unmaps it with the process
            pass
        os.close(self.fd)


@dataclass(slots=True)
class Packed:
    """What :func:`put` made of some arrays: descriptors for the header, the blocks it took, the bytes
    that go inline."""

    refs: list[tuple] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    inline: list[bytes | memoryview] = field(default_factory=list)
    inline_bytes: int = 0


#: dtype tag (``dtype.str``, which numpy builds anew at each access) by dtype, and dtype by tag: the
#: few dtypes a server sees, looked up once per tensor crossing
_TAGS: dict[np.dtype, str] = {}
_DTYPES: dict[str, np.dtype] = {}


def _tag(dtype: np.dtype) -> str:
    tag = _TAGS.get(dtype)
    if tag is None:
        tag = _TAGS[dtype] = dtype.str
    return tag


def _dtype(tag: str) -> np.dtype:
    dtype = _DTYPES.get(tag)
    if dtype is None:
        dtype = _DTYPES[tag] = np.dtype(tag)
    return dtype


def _raw(array: np.ndarray) -> tuple[str, memoryview | bytes, int]:
    """(dtype tag, bytes, element count): BYTES tensors in Triton's 4-byte length-prefixed form."""
    if array.dtype == np.object_:
        return "BYTES", serialize_bytes(array), array.size
    if array.size == 0:
        return _tag(array.dtype), b"", 0
    array = np.ascontiguousarray(array).reshape(-1)
    return _tag(array.dtype), memoryview(array).cast("B"), array.size


def put(arena: Arena | None, arrays: list[np.ndarray], packed: Packed | None = None) -> Packed:
    """Write arrays into the arena (inline where they do not fit); refs[i] describes arrays[i] as
    (where, offset, nbytes, dtype tag, shape, count) with where "s" (arena) or "i" (inline payload)."""
    packed = packed or Packed()
    for array in arrays:
        tag, raw, count = _raw(np.asarray(array))
        n = len(raw)
        offset = arena.alloc(n) if arena is not None and n else None
        if offset is None:
            packed.refs.append(("i", packed.inline_bytes, n, tag, array.shape, count))
            packed.inline.append(raw)
            packed.inline_bytes += n
        else:
            arena.view[offset:offset + n] = raw  # type: ignore[union-attr]
            packed.blocks.append(offset)
            packed.refs.append(("s", offset, n, tag, array.shape, count))
    return packed


def take(view: memoryview | None, inline: memoryview, ref: tuple, *, copy: bool) -> np.ndarray:
    """One array back from its descriptor; ``copy`` False gives a view into shared memory (valid until
    the writer frees the block)."""
    where, offset, n, tag, shape, count = ref
    source = view if where == "s" else inline
    raw = source[offset:offset + n]  # type: ignore[index]
    if tag == "BYTES":
        return deserialize_bytes(raw, count, "tensor").reshape(shape)
    array = np.frombuffer(raw, dtype=_dtype(tag), count=count).reshape(shape)
    return array.copy() if copy else array


def attach(fd: int) -> tuple[mmap.mmap, memoryview]:
    """Map a peer's arena (read side): the mapping and a view of it."""
    size = os.fstat(fd).st_size
    m = mmap.mmap(fd, size)
    os.close(fd)
    return m, memoryview(m)


def stackable(arrays: list) -> bool:
    """Whether these arrays can be written as one block (:func:`put_rows`): numeric, at least one
    dimension, one dtype and the same shape past the first dimension."""
    first = arrays[0]
    if not isinstance(first, np.ndarray) or first.ndim == 0 or first.dtype.hasobject:
        return False
    if len(arrays) == 1:
        return True
    dtype, rest = first.dtype, first.shape[1:]
    return all(isinstance(a, np.ndarray) and a.ndim and a.dtype == dtype and a.shape[1:] == rest for a in arrays)


def put_rows(arena: Arena | None, arrays: list[np.ndarray], packed: Packed) -> None:
    """Arrays that :func:`stackable` accepted, written back to back as ONE block (one copy, in C: a batch
    of n requests costs one descriptor, not n); its ref describes the stacked array, which
    :func:`take_rows` cuts back into the pieces."""
    first = arrays[0]
    if len(arrays) == 1:  # one request's array (every batch at concurrency 1)
        shape, count, n = first.shape, first.size, first.nbytes
    else:
        shape = (sum(a.shape[0] for a in arrays), *first.shape[1:])
        count = math.prod(shape)  # not np.prod: ~6 µs of numpy reduction on a tuple, per input per batch
        n = count * first.dtype.itemsize
    offset = arena.alloc(n) if arena is not None and n else None
    if offset is None:
        # C order whatever the pieces' (concatenate keeps a transposed piece's Fortran order, whose bytes
        # a memoryview cannot cast)
        stacked = np.empty(shape, first.dtype)
        np.concatenate(arrays, axis=0, out=stacked)
        packed.refs.append(("i", packed.inline_bytes, n, _tag(first.dtype), shape, count))
        packed.inline.append(memoryview(stacked).cast("B") if n else b"")
        packed.inline_bytes += n
        return
    if len(arrays) == 1 and first.flags.c_contiguous:
        # its bytes copied straight into the block, no ndarray over the mapping and no concatenate (warm
        # 46 -> 19 us for one 1 KB output with its pack_dicts, 87 -> 39 us right after a 1 ms sleep, as an
        # instance process runs it at c=1)
        arena.view[offset:offset + n] = memoryview(first).cast("B")  # type: ignore[union-attr]
    else:
        out = np.ndarray(shape, first.dtype, buffer=arena.map, offset=offset)  # type: ignore[union-attr]
        np.concatenate(arrays, axis=0, out=out)
    packed.blocks.append(offset)
    packed.refs.append(("s", offset, n, _tag(first.dtype), shape, count))


def take_rows(view: memoryview | None, inline: memoryview, ref: tuple, rows: list[int], *, copy: bool) -> list:
    """The pieces :func:`put_rows` stacked (``rows``: each one's first dimension), as views of one array
    (of one copy of the block when ``copy``)."""
    whole = take(view, inline, ref, copy=copy)
    if len(rows) == 1:  # one request's: the array itself, not a view of all its rows
        return [whole]
    out, at = [], 0
    for k in rows:
        out.append(whole[at:at + k])
        at += k
    return out
