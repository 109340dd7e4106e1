"""Which rank hashes which share of a checkpoint file on a restore: ranks on one host that read the very
same file (same boot, same inode: a DDP restore, where every rank loads the whole checkpoint) hash it once
between them, taking turns digest segment by digest segment (:mod:`azulite.train.digest`; a file with one
digest is hashed whole by one of them), each only copying the others' segments (:mod:`azulite.train.reader`).
The split travels in DCP's own plans: each rank's local plan names the identity of every file it reads
(:class:`Identities`), and the coordinator's global plan tells each rank what it hashes (:class:`HashHere`,
from :func:`assign_hashing`); no collective of our own before the reads.
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
    """What the coordinator's global plan hands back to each rank: for each file it hashes a share of,
    ``(slot, of)``: it hashes the file's digest segments ``k`` with ``k % of == slot``
    (:class:`azulite.train.digest.Checker`; ``(0, 1)``: all of them); ``known``, the files the coordinator
    saw it read. A file the rank reads beyond those it hashes all of itself."""

    files: dict[str, tuple[int, int]]
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


def assign_hashing(readers_files: list[Mapping[str, Any]], sizes: Mapping[str, int],
                   segments: Mapping[str, int] | None = None) -> list[dict[str, tuple[int, int]]]:
    """Which share of which file each rank hashes (``{file: (slot, of)}``, see :class:`HashHere`), given
    each rank's ``{file: identity}`` (index: the rank in the load's group) and each file's number of
    digest ``segments`` (1, the default: a whole-file digest). A file that several ranks read from the
    very same bytes (an equal, non-None identity) is hashed once between them: one with segments by
    all of them in turn, segment by segment, the turns running on across files in the order they are read
    (by name), so every stretch of the stream is hashed by each in its turn and none is left, after the
    disk's last byte, hashing a whole last file alone; one with a whole-file digest by one of them, files
    handed out greedily by size so the bytes split evenly. A file with no identity (a Blob download, or
    not there: it fails when read) is hashed by its reader."""
    segments = segments or {}
    readers: dict[tuple[str, Any], list[int]] = {}
    here: list[dict[str, tuple[int, int]]] = [{} for _ in readers_files]
    for rank, files in enumerate(readers_files):
        for name, ident in files.items():
            if ident is None:
                here[rank][name] = (0, 1)
            else:
                readers.setdefault((name, ident), []).append(rank)
    load = [0] * len(readers_files)
    turn = 0
    for name, ident in sorted(k for k in readers if segments.get(k[0], 1) > 1):
        ranks = readers[(name, ident)]
        for j, rank in enumerate(ranks):  # segment k is hashed by ranks[(turn + k) % len(ranks)]
            here[rank][name] = ((j - turn) % len(ranks), len(ranks))
            load[rank] += sizes.get(name, 0) // len(ranks)
        turn += segments[name]
    whole = [k for k in readers if segments.get(k[0], 1) <= 1]
    for name, ident in sorted(whole, key=lambda k: (-sizes.get(k[0], 0), k[0], repr(k[1]))):
        rank = min(readers[(name, ident)], key=lambda r: (load[r], r))
        load[rank] += sizes.get(name, 0)
        here[rank][name] = (0, 1)
    return here
