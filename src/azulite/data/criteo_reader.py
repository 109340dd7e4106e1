"""Streaming, rank-sharded, resumable reader of Criteo TSV (plain or gzip), and :func:`open_reader`, which
picks the reader for what a dataset path holds (TSV here, TorchRec's npy layout in
:mod:`azulite.data.criteo_npy_reader`). The chunking, the split and the position every reader shares are
:class:`~azulite.data.criteo_stream.ChunkStream`'s.

A TSV rank checks every line against the format (a cheap regex: the malformed-line rule must be the same
on every rank) but parses only its own rows. Malformed lines (wrong field count, a non-hex category, a
non-integer dense value, a label other than 0/1) are skipped with a warning naming the file and line
(rank 0 warns), and counted: more than ``max_bad_fraction`` of the lines read (checked every 10,000 lines
and at the end of each file) is a :class:`~azulite.errors.DataError`. Hand-written rather than
``torchrec.datasets.criteo.CriteoIterDataPipe``, which turns bad values into 0 silently, shards by whole
files and has no position to resume from.
"""

from __future__ import annotations

import gzip
import logging
import os
import re
import zlib
from collections.abc import Sequence
from typing import Any, BinaryIO

import numpy as np

from azulite.data.criteo import FIELD_COUNT, INT_FEATURE_COUNT, LINE_RE, transform_dense
from azulite.data.criteo_npy_reader import CriteoNpyReader
# Rows and list_files: the names callers have always imported from here
from azulite.data.criteo_stream import ChunkStream, Rows, list_files
from azulite.errors import DataError

__all__ = ["CriteoNpyReader", "CriteoTSVReader", "Rows", "describe_bad_line", "list_files", "open_reader"]

log = logging.getLogger(__name__)

_CHECK_EVERY = 10_000
# one field of LINE_RE each (empty allowed: 0, id 0), to name the field a malformed line breaks the rule in
_DENSE = re.compile(rb"-?[0-9]*")
_CATEGORY = re.compile(rb"[0-9a-fA-F]{0,16}")
_HEX = re.compile(rb"[0-9a-fA-F]+")
_MAX_WARNINGS_PER_FILE = 20


class CriteoTSVReader(ChunkStream):
    """Criteo TSV lines (plain or gzip), streamed: one line in memory at a time plus this rank's rows."""

    def __init__(self, files: Sequence[str], **kw: Any) -> None:
        super().__init__(files, **kw)
        self._f: BinaryIO | None = None
        self._warned = 0

    def _close(self) -> None:
        if getattr(self, "_f", None) is not None:
            self._f.close()
        self._f = None
        self._open_index = None

    def _open(self, index: int) -> BinaryIO:
        if self._f is None or self._open_index != index:
            self._close()
            path = self.files[index]
            raw = open(path, "rb")  # noqa: SIM115 - kept open across chunks
            gz = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            self._f = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
            self._open_index = index
            self._warned = 0
            if self.offset:
                self._guard(index, lambda: self._f.seek(self.offset))
        return self._f

    def _guard(self, index: int, fn: Any) -> Any:
        try:
            return fn()
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            path = self.files[index]
            self._close()
            raise DataError(f"{path} is not a readable gzip file ({e}): truncated or corrupt", where=path,
                            fix="download or copy the file again (gzip -t FILE checks it)") from None

    def _take(self, index: int, n: int, chunk_start: int) -> tuple[Rows | None, int]:
        f = self._open(index)
        path = self.files[index]
        mine = set(self._own(chunk_start, n))
        own_lines: list[bytes] = []
        taken = 0
        while taken < n:
            line = self._guard(index, f.readline)
            if not line:
                self._check_bad(path, final=True)
                break
            self.offset += len(line)
            self.line_no += 1
            if LINE_RE.fullmatch(line) is None:
                if line.strip() == b"":
                    continue  # a blank line (a trailing newline at the end of a file) is no row
                self.bad += 1
                self._warn_bad(path, line)
                if self.line_no % _CHECK_EVERY == 0:
                    self._check_bad(path)
                continue
            row = self.row_no
            self.row_no += 1
            if self.line_no % _CHECK_EVERY == 0:
                self._check_bad(path)
            if not self._wanted(row):
                continue
            if taken in mine:
                own_lines.append(line)
            taken += 1
        if not own_lines:
            return None, taken
        return self._parse(own_lines), taken

    def _parse(self, lines: list[bytes]) -> Rows:
        fields = [ln.rstrip(b"\r\n").split(b"\t") for ln in lines]
        labels = np.array([int(r[0]) for r in fields], dtype=np.float32)
        # "" and a lone "-" (the line rule lets it through, as serving does) read as 0
        dense = np.array([[int(x) if x and x != b"-" else 0 for x in r[1 : 1 + INT_FEATURE_COUNT]] for r in fields],
                         dtype=np.int64)
        ids = np.array([[int(x, 16) if x else 0 for x in r[1 + INT_FEATURE_COUNT :]] for r in fields], dtype=np.int64)
        return Rows(transform_dense(dense), self._hash(ids), labels,
                    np.ones(len(lines), np.float32))

    def _warn_bad(self, path: str, line: bytes) -> None:
        if not self.warn:
            return
        self._warned += 1
        if self._warned <= _MAX_WARNINGS_PER_FILE:
            log.warning("%s:%d: malformed Criteo line skipped (%s)", path, self.line_no, describe_bad_line(line))
        elif self._warned == _MAX_WARNINGS_PER_FILE + 1:
            log.warning("%s: more malformed lines; only the count is reported from now on", path)

    def _check_bad(self, path: str, final: bool = False) -> None:
        if self.line_no and self.bad > self.max_bad_fraction * self.line_no:
            raise DataError(
                f"{self.bad} of the first {self.line_no} lines are malformed ({self.bad / self.line_no:.2%}), more "
                f"than the limit of {self.max_bad_fraction:.2%}", where=path,
                fix="check the file is Criteo TSV (label, 13 integers, 26 hex categories, tab-separated), or "
                    "raise the limit with --max_bad_lines_fraction")


def describe_bad_line(line: bytes) -> str:
    """Why a line is malformed, in words (the warning's reason): the first field that breaks the line rule
    (:data:`azulite.data.criteo.LINE_RE`), checked field by field with that rule's own patterns. An empty
    dense value or category is legitimate (0, id 0): it is never the one named."""
    fields = line.rstrip(b"\r\n").split(b"\t")
    if len(fields) != FIELD_COUNT:
        return f"{len(fields)} fields, expected {FIELD_COUNT}"
    if fields[0] not in (b"0", b"1"):
        return f"label {fields[0][:20]!r} is not 0 or 1"
    for i, x in enumerate(fields[1 : 1 + INT_FEATURE_COUNT]):
        if _DENSE.fullmatch(x) is None:
            return f"dense feature I{i + 1} {x[:20]!r} is not an integer"
    for i, x in enumerate(fields[1 + INT_FEATURE_COUNT :]):
        if _CATEGORY.fullmatch(x) is None:
            what = "is longer than 16 hex digits" if _HEX.fullmatch(x) else "is not a hex string"
            return f"category C{i + 1} {x[:20]!r} {what}"
    return "unreadable bytes"


def open_reader(dataset_path: str | os.PathLike, **kw: Any) -> ChunkStream:
    """The reader for whatever ``dataset_path`` holds (see :func:`list_files`)."""
    kind, files = list_files(dataset_path)
    reader = CriteoNpyReader(files, **kw) if kind == "npy" else CriteoTSVReader(files, **kw)
    reader.source = str(dataset_path)
    return reader
