"""Verifying a sealed audit log (``azulite audit verify``): the seals serve/audit_writer.py writes are
recomputed over the lines they seal, and each is held to the one before it, across the rotated files
oldest first (``LOG.5`` ... ``LOG.1``, ``LOG``). The first place the chain does not hold is reported: which
file, which lines, and what it means (a line changed, lines added or removed, a write removed whole, lines
no seal covers). The oldest file's first seal may chain to a file rotation has deleted: that is where the
kept log begins, not a break.

Why by hand: the chain is azulite's own line format (a hash per write, not per line, so sealing costs the
writer process one hash of bytes it already joined), and hashlib/hmac do the cryptography."""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from azulite.errors import AuditError
from azulite.serve.audit_writer import seal_hash, seal_of


def log_files(path: Path | str) -> list[Path]:
    """The log's files oldest first: the rotated ones (``.N`` ... ``.1``), then the live one."""
    path = Path(path)
    rotated = []
    for p in path.parent.glob(f"{path.name}.*") if path.parent.is_dir() else ():
        m = re.fullmatch(re.escape(path.name) + r"\.(\d+)", p.name)
        if m:
            rotated.append((int(m.group(1)), p))
    files = [p for _, p in sorted(rotated, reverse=True)]
    return files + [path] if path.exists() else files


@dataclass
class Verdict:
    files: list[Path]
    lines: int = 0  # request lines under a seal that held
    seals: int = 0
    alg: str = ""
    problem: str | None = None
    where: str | None = None  # "FILE lines A-B"

    @property
    def ok(self) -> bool:
        return self.problem is None


def _numbered(file: Path):
    """(line number, line with its newline) of the file, read as it goes."""
    try:
        with open(file, "rb") as f:
            yield from enumerate(f, start=1)
    except OSError as exc:
        raise AuditError(f"cannot read the audit log: {exc.strerror or exc}", where=str(file)) from None


def _n(lines: int) -> str:
    return f"{lines} line" if lines == 1 else f"{lines} lines"


def verify(path: Path | str, key: bytes | None = None) -> Verdict:
    """The verdict on the log at ``path`` and its rotated files; ``key``: the HMAC key it was sealed with."""
    files = log_files(path)
    if not files:
        raise AuditError("no audit log here", where=str(path), fix="name the file --audit-log wrote")
    verdict = Verdict(files)
    prev: str | None = None  # the last seal's hash (None before the first)
    pending: list[bytes] = []
    start: tuple[Path, int] = (files[0], 0)  # where the unsealed lines (pending) begin

    def broken(problem: str, file: Path, first: int, last: int) -> Verdict:
        verdict.problem = problem
        verdict.where = f"{file} line {first}" if first == last else f"{file} lines {first}-{last}"
        return verdict

    for file in files:
        for number, line in _numbered(file):  # streamed: a log is up to 6 x 64 MiB; one write's lines held
            if not line.endswith(b"\n"):
                return broken("the file ends within a line: a write was cut short", file, number, number)
            seal = seal_of(line)
            if seal is None:
                if not pending:
                    start = (file, number)
                pending.append(line)
                continue
            first = start[1] if pending and start[0] == file else number
            alg, count, seal_prev, seal_hash_ = (seal.get(k) for k in ("alg", "lines", "prev", "hash"))
            if not (isinstance(count, int) and isinstance(seal_prev, str) and isinstance(seal_hash_, str)):
                return broken("a seal line without its fields (lines, prev, hash)", file, number, number)
            if alg == "hmac-sha256" and not key:
                raise AuditError("the log is sealed with a key", where=f"{file} line {number}",
                                 fix="pass the key the server was given: azulite audit verify LOG --key FILE")
            if alg != ("hmac-sha256" if key else "sha256"):
                return broken(f"a seal made with {alg!r}, not with the key given", file, number, number)
            if pending and start[0] != file:
                return broken(f"{_n(len(pending))} at the end of {start[0]} under no seal", start[0],
                              start[1], start[1] + len(pending) - 1)
            if prev is None and not seal_prev and count < len(pending):
                return broken(f"{_n(len(pending) - count)} before the chain starts (written before "
                              "sealing was on, or added): no seal covers them", file, first,
                              first + len(pending) - count - 1)
            if count != len(pending):
                return broken(f"the seal covers {count} lines and {len(pending)} stand before it: lines were "
                              f"{'removed' if count > len(pending) else 'added'}", file, first, number)
            if prev is not None and seal_prev != prev:
                what = ("a new chain starts here: the log before it ended without a seal (a write cut short, or "
                        "lines written unsealed)" if not seal_prev else
                        "this seal does not follow the one before it: a whole write was removed, or lines "
                        "from another log put in")
                return broken(what, file, first, number)
            if not hmac.compare_digest(seal_hash(key, seal_prev, b"".join(pending)), seal_hash_):
                return broken("a line under this seal was changed", file, first, number)
            prev, pending = seal_hash_, []
            verdict.seals += 1
            verdict.lines += count
            verdict.alg = alg
    if verdict.seals == 0:
        verdict.problem = "no seal in the log: it was not written with --audit-seal or --audit-key"
        verdict.where = str(files[-1])
    elif pending:
        return broken(f"{_n(len(pending))} after the last seal, under none: written by something else, or "
                      "being written now (verify a stopped server's log, or again)", start[0], start[1],
                      start[1] + len(pending) - 1)
    return verdict
