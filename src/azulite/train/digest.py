"""The hash a checkpoint manifest records for every file, and how a file is checked against it.

BLAKE3 (the ``blake3`` package, the reference Rust implementation): a cryptographic hash like sha256, but
several times faster per core (SIMD, AVX-512 where the CPU has it) and it releases the GIL while it
hashes, so files hash in parallel threads. On a restore every rank hashes every byte it loads (a DDP rank
loads all of the checkpoint), and with sha256 (about 1.4 GB/s per core here) that alone took longer than
``torch.load`` of the whole state. Manifests written before record ``sha256``; they are still checked
with it.

A new manifest entry records one BLAKE3 digest per :data:`SEGMENT` bytes of the file
(``blake3_segments``), not one for the whole file: ranks that restore the very same file split its
hashing segment by segment, in the order the bytes arrive (:mod:`azulite.train.hash_split`), so at every
moment of a cold restore each rank hashes its share of what the disk just brought. With one digest per
file a rank hashed whole files, and the one that hashed the last file read still hashed it after the
disk's last byte while the others waited (the restore's tail). Every byte is still covered by exactly one
digest, at its position; entries with one whole-file digest (``blake3`` or ``sha256``, written before)
are checked as one segment.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import blake3

from azulite.errors import CheckpointError

#: the algorithm new manifests record
ALGORITHM = "blake3"
KNOWN = ("blake3", "sha256")
#: bytes per digest of a new entry: fine enough that ranks sharing a file's hashing stay in step with
#: the disk, coarse enough that a 100 GB checkpoint's manifest stays under half a MB
SEGMENT = 16 << 20
#: the key of a new entry's digests (one per SEGMENT bytes, in order) and of its segment size
SEGMENTS, SEGMENT_BYTES = "blake3_segments", "segment_bytes"
#: the segment size that makes a whole-file entry one segment
_WHOLE = 1 << 62


class IntegrityError(CheckpointError):
    """A checkpoint file that is missing or does not match its manifest: the checkpoint is corrupt."""


def new(algorithm: str = ALGORITHM) -> Any:
    """A hasher with ``update(bytes-like)`` and ``hexdigest()``."""
    if algorithm == "blake3":
        return blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checkpoint hash {algorithm!r} (known: {', '.join(KNOWN)})")


def algorithm_of(entry: Mapping[str, Any]) -> str:
    """The algorithm a manifest entry was hashed with: the one it has a digest for."""
    if SEGMENTS in entry:
        return ALGORITHM
    for name in KNOWN:
        if name in entry:
            return name
    raise IntegrityError(f"the manifest entry {dict(entry)!r} has no digest ({' or '.join(KNOWN)})")


def entry(hexdigest: str, nbytes: int, algorithm: str = ALGORITHM) -> dict[str, Any]:
    """A whole-file entry (the form manifests had before segments)."""
    return {algorithm: hexdigest, "bytes": nbytes}


def segments_of(want: Mapping[str, Any]) -> tuple[str, int, list[str]]:
    """(algorithm, segment size, digests) of a manifest entry; a whole-file entry is one segment. Raises
    IntegrityError when the entry is not one this can check (its digests do not cover its bytes)."""
    nbytes = want.get("bytes")
    if not isinstance(nbytes, int) or nbytes < 0:
        raise IntegrityError(f"the manifest entry {dict(want)!r} has no valid size ('bytes')")
    if SEGMENTS not in want:
        algorithm = algorithm_of(want)
        return algorithm, _WHOLE, [want[algorithm]]
    size, digests = want.get(SEGMENT_BYTES), want[SEGMENTS]
    if (not isinstance(size, int) or size <= 0 or not isinstance(digests, list)
            or len(digests) != max(1, -(-nbytes // size)) or not all(isinstance(d, str) for d in digests)):
        raise IntegrityError(f"the manifest entry's {SEGMENTS} do not cover its {nbytes} B "
                             f"({SEGMENT_BYTES} {size!r}, {len(digests) if isinstance(digests, list) else 0} digests)")
    return ALGORITHM, size, digests


class Segmenter:
    """Builds a new manifest entry from a file's bytes fed in order (one digest per :data:`SEGMENT`)."""

    def __init__(self, segment: int | None = None) -> None:
        self._size, self._h, self._digests, self.nbytes = segment or SEGMENT, new(), [], 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            room = self._size - self.nbytes % self._size
            self._h.update(view[:room])  # releases the GIL on large buffers
            self.nbytes += min(room, len(view))
            view = view[room:]
            if self.nbytes % self._size == 0:
                self._digests.append(self._h.hexdigest())
                self._h = new()

    def entry(self) -> dict[str, Any]:
        digests = list(self._digests)
        if self.nbytes % self._size or not digests:  # the last, partial segment (or an empty file's one)
            digests.append(self._h.hexdigest())
        return {SEGMENTS: digests, SEGMENT_BYTES: self._size, "bytes": self.nbytes}


class Checker:
    """Checks a file's bytes, fed in order with their offsets, against its manifest entry: each segment
    ``mine(k)`` says this reader hashes is compared when its last byte arrived (the others are another
    reader's of the very same bytes); :meth:`finish` checks the size. Raises IntegrityError naming the
    file and, for a segmented entry, the bytes that do not match."""

    def __init__(self, want: Mapping[str, Any], name: str, where: str, mine: Any = None) -> None:
        self.algorithm, self._size, self._digests = segments_of(want)
        self._want, self._name, self._where = want, name, f" [{where}]" if where else ""
        self._mine = mine if mine is not None else (lambda k: True)
        self._k, self._at, self._h = 0, 0, None
        #: bytes this reader hashed
        self.hashed = 0
        self._start(0)

    def _start(self, k: int) -> None:
        self._k = k
        self._h = new(self.algorithm) if k < len(self._digests) and self._mine(k) else None

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            end = (self._k + 1) * self._size
            piece = view[: end - self._at]
            if self._h is not None:
                self._h.update(piece)  # releases the GIL on large buffers
                self.hashed += len(piece)
            self._at += len(piece)
            view = view[len(piece):]
            if self._at == end:
                self._close()

    def _close(self) -> None:
        if self._h is not None and self._k < len(self._digests):
            got = self._h.hexdigest()
            if got != self._digests[self._k]:
                self._fail(got)
        self._start(self._k + 1)

    def finish(self) -> None:
        want = self._want["bytes"]
        if self._at == want and self._k < len(self._digests):
            self._close()  # the last segment when it is partial (a whole-file entry's only one, an empty file's)
        if self._at != want:
            raise IntegrityError(f"file {self._name} is {self._at} B, the manifest says {want} B{self._where}")

    def _fail(self, got: str) -> None:
        want = self._digests[self._k]
        if self._size == _WHOLE:
            raise IntegrityError(f"file {self._name} does not match the manifest ({self.algorithm} {got[:12]}.. "
                                 f"{self._at} B, expected {want[:12]}.. {self._want['bytes']} B){self._where}")
        lo = self._k * self._size
        raise IntegrityError(f"file {self._name} does not match the manifest ({self.algorithm} of bytes "
                             f"[{lo}, {self._at}) {got[:12]}.., expected {want[:12]}..){self._where}")


def check_bytes(data: Any, want: Mapping[str, Any], name: str, where: str) -> None:
    """Raises IntegrityError unless ``data`` is the file ``want`` describes."""
    c = Checker(want, name, where)
    c.update(data)
    c.finish()


def check_file(path: str | os.PathLike, want: Mapping[str, Any], name: str, where: str) -> None:
    """Raises IntegrityError unless the file at ``path`` is the one ``want`` describes (read once)."""
    c = Checker(want, name, where)
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 << 20):
            c.update(chunk)
    c.finish()


def file_entry(path: str | os.PathLike, algorithm: str = ALGORITHM) -> dict[str, Any]:
    """The manifest entry of a file: its segment digests and size (``sha256``: one whole-file digest, the
    form of old manifests), read once in large chunks."""
    if algorithm != ALGORITHM:
        h, n = new(algorithm), 0
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
                n += len(chunk)
        return entry(h.hexdigest(), n, algorithm)
    s = Segmenter()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 << 20):
            s.update(chunk)  # releases the GIL on large buffers: files hash in parallel threads
    return s.entry()
