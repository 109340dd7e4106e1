"""The hash a checkpoint manifest records for every file, and how a file is checked against it.

BLAKE3 (the ``blake3`` package, the reference Rust implementation): a cryptographic hash like sha256, but
several times faster per core (SIMD, AVX-512 where the CPU has it) and it releases the GIL while it
hashes, so files hash in parallel threads. On a restore every rank hashes every byte it loads (a DDP rank
loads all of the checkpoint), and with sha256 (about 1.4 GB/s per core here) that alone took longer than
``torch.load`` of the whole state. Manifests written before record ``sha256``; they are still checked
with it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import blake3

from azulite.errors import CheckpointError

#: the algorithm new manifests record (the key of each file's entry)
ALGORITHM = "blake3"
KNOWN = ("blake3", "sha256")


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
    for name in KNOWN:
        if name in entry:
            return name
    raise IntegrityError(f"the manifest entry {dict(entry)!r} has no digest ({' or '.join(KNOWN)})")


def entry(hexdigest: str, nbytes: int, algorithm: str = ALGORITHM) -> dict[str, Any]:
    return {algorithm: hexdigest, "bytes": nbytes}


def file_entry(path: str | os.PathLike, algorithm: str = ALGORITHM) -> dict[str, Any]:
    """The manifest entry of a file: its digest and size, read once in large chunks."""
    h, n = new(algorithm), 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)  # releases the GIL on large buffers: files hash in parallel threads
            n += len(chunk)
    return entry(h.hexdigest(), n, algorithm)
