"""Which rank hashes which checkpoint file on a restore: ranks on one host that read the very same file
(same boot, same inode: a DDP restore, where every rank loads the whole checkpoint) hash it once between
them, the bytes split evenly, and the others only copy it (:mod:`azulite.train.reader`). The split travels
in DCP's own plans: each rank's local plan names the identity of every file it reads (:class:`Identities`),
and the coordinator's global plan tells each rank what it hashes (:class:`HashHere`, from
:func:`assign_hashing`); no collective of our own before the reads.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Identities:
    """What a rank's local plan carries to DCP's coordinator (``LoadPlan.storage_data``): the identity of
    each file it reads (:func:`identity`; None where its bytes are its own, a Blob download)."""

    files: dict[str, Any]


@dataclass(frozen=True)
class HashHere:
    """What the coordinator's global plan hands back to each rank: the files it hashes, of those the
    coordinator saw it read (``known``); a file the rank reads beyond those it hashes itself."""

    files: frozenset[str]
    known: frozenset[str]


@functools.cache
def _host() -> tuple[str, str]:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def identity(path: Path) -> tuple[Any, ...] | None:
    """What makes two ranks' reads of a path the same bytes: one host (and boot), one inode, unchanged."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (*_host(), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def assign_hashing(readers_files: list[Mapping[str, Any]], sizes: Mapping[str, int]) -> list[set[str]]:
    """Which files each rank hashes, given each rank's ``{file: identity}`` (index: the rank in the
    load's group): every file a rank reads, except those another rank reads from the very same bytes
    (an equal, non-None identity) and hashes instead. A file's readers share it by size, greedily, so the
    hashing splits evenly: for DDP, where every rank reads the whole checkpoint, each hashes 1/N of it.
    (Handing files out in read order instead, so that the files read last are not both one rank's to
    hash, measured the same near idle: 1,396 vs 1,346 and 1,647 vs 1,682 MB/s cold, interleaved.)
    A file with no identity (a Blob download, or not there: it fails when read) is hashed by its reader."""
    readers: dict[tuple[str, Any], list[int]] = {}
    here: list[set[str]] = [set() for _ in readers_files]
    for rank, files in enumerate(readers_files):
        for name, ident in files.items():
            if ident is None:
                here[rank].add(name)
            else:
                readers.setdefault((name, ident), []).append(rank)
    load = [0] * len(readers_files)
    for name, ident in sorted(readers, key=lambda k: (-sizes.get(k[0], 0), k[0], repr(k[1]))):
        rank = min(readers[(name, ident)], key=lambda r: (load[r], r))
        load[rank] += sizes.get(name, 0)
        here[rank].add(name)
    return here
