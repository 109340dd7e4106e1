"""Streaming, rank-sharded, resumable readers of Criteo data: TSV (plain or gzip) and TorchRec's npy layout.

Every rank walks the same files in the same order and cuts the same *chunks* of ``world_size x
batch_size`` rows; row ``k`` of a chunk belongs to rank ``k % world_size``. So every step gives every rank
exactly ``batch_size`` rows, all ranks see the end of the data at the same chunk (a sharded model's
collectives need every rank in every step) without talking to each other, and the global batch is the
same rows whatever the world size. A TSV rank checks every line against the format (a cheap regex: the
malformed-line rule must be the same on every rank) but parses only its own rows.

The position — epoch, file, byte offset, line and row numbers — is a small ``state_dict``, saved with the
checkpoint and restored by seeking (a gzip file is decompressed up to the offset again). The file order
is shuffled per epoch with ``numpy.random.default_rng([seed, epoch])``: the epoch is the RNG state.

Held-out rows: with ``validation_permille = v``, row ``i`` of a file (counting only well-formed rows) is
held out when ``i % 1000 < v``; the train split reads the rest. The npy converter keeps well-formed rows
only, so both formats hold out the same rows.

Malformed TSV lines (wrong field count, a non-hex category, a non-integer dense value, a label other than
0/1) are skipped with a warning naming the file and line (rank 0 warns), and counted: more than
``max_bad_fraction`` of the lines read (checked every 10,000 lines and at the end of each file) is a
:class:`~azulite.errors.DataError`. Hand-written rather than ``torchrec.datasets.criteo.CriteoIterDataPipe``,
which turns bad values into 0 silently, shards by whole files and has no position to resume from.
"""

from __future__ import annotations

import gzip
import logging
import os
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from azulite.data.criteo import (
    CAT_FEATURE_COUNT,
    FIELD_COUNT,
    INT_FEATURE_COUNT,
    LINE_RE,
    hash_ids,
    transform_dense,
)
from azulite.errors import DataError

log = logging.getLogger(__name__)

_CHECK_EVERY = 10_000
_MAX_WARNINGS_PER_FILE = 20


@dataclass
class Rows:
    """This rank's rows of one chunk: model inputs after preprocessing. ``weight`` is 0 for padding."""

    dense: np.ndarray  # float32 [B, 13], log(1 + max(x, 0))
    sparse: np.ndarray  # int64 [B, 26], table rows
    labels: np.ndarray  # float32 [B]
    weight: np.ndarray  # float32 [B]: 1 real row, 0 padding (the validation split's last chunk)


def list_files(dataset_path: str | os.PathLike) -> tuple[str, list[str]]:
    """``("npy", [day prefixes])`` for a folder of ``day_N_{dense,sparse,labels}.npy``, else ``("tsv",
    [files])`` for one TSV file or a folder of them (sorted; ``.gz`` read as gzip)."""
    p = Path(dataset_path)
    if not p.exists():
        raise DataError(f"dataset path {str(p)!r} does not exist", where="--dataset_path",
                        fix="pass a Criteo TSV file, a folder of them, or a folder of day_N_*.npy files")
    if p.is_file():
        return "tsv", [str(p)]
    dense = sorted(p.glob("*_dense.npy"))
    if dense:
        prefixes = [str(d)[: -len("_dense.npy")] for d in dense]
        for pre in prefixes:
            for part in ("sparse", "labels"):
                if not os.path.exists(f"{pre}_{part}.npy"):
                    raise DataError(f"{pre}_dense.npy has no {pre}_{part}.npy beside it", where=str(p),
                                    fix="convert the TSV again (python -m azulite.data.criteo_npy)")
        return "npy", sorted(prefixes, key=_natural)
    files = sorted((str(f) for f in p.iterdir() if f.is_file() and not f.name.startswith(".")
                    and f.suffix not in (".npy", ".json", ".md")), key=_natural)
    if not files:
        raise DataError(f"folder {str(p)!r} holds no data files", where="--dataset_path",
                        fix="put Criteo TSV files (day_0, day_1.gz, ...) or day_N_*.npy files in it")
    return "tsv", files


def _natural(s: str) -> tuple:
    import re

    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s))


class _Stream:
    """Chunking, epochs, file order and the position; subclasses read rows out of one file."""

    def __init__(self, files: Sequence[str], *, rank: int, world_size: int, batch_size: int,
                 num_embeddings_per_feature: Sequence[int] | None, split: str = "train", validation_permille: int = 0,
                 seed: int = 0, shuffle_files: bool = True, max_bad_fraction: float = 0.001,
                 warn: bool | None = None) -> None:
        if split not in ("train", "val", "all"):
            raise ValueError(f"split {split!r}")
        if not 0 <= validation_permille < 1000:
            raise DataError(f"validation share {validation_permille}/1000 must be in [0, 1000)",
                            where="--validation_fraction", fix="e.g. 0.1")
        if split == "val" and validation_permille == 0:
            raise DataError("no rows are held out for validation", where="--validation_fraction", fix="e.g. 0.1")
        self.files = list(files)
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        #: None: raw ids (the npy converter)
        self.num_embeddings = (None if num_embeddings_per_feature is None
                               else np.asarray(num_embeddings_per_feature, dtype=np.int64))
        self.split, self.permille = split, validation_permille
        self.seed, self.shuffle = seed, shuffle_files and split == "train"
        self.max_bad_fraction = max_bad_fraction
        self.warn = rank == 0 if warn is None else warn
        # the position: epoch, index into this epoch's file order, and the place in that file
        self.epoch = 0
        self.file_pos = 0
        self.offset = 0  # bytes (TSV, uncompressed) into the file
        self.line_no = 0  # lines read in the file
        self.row_no = 0  # well-formed rows read in the file
        self.bad = 0  # malformed lines in the file so far
        self.chunks = 0  # chunks handed out this epoch
        self._open_index: int | None = None
        self._order: tuple[int, list[int]] | None = None

    # --- position -------------------------------------------------------------------------------------
    def order(self) -> list[int]:
        """This epoch's file order (made once per epoch: a seeded generator costs more than a step's reads)."""
        if self._order is None or self._order[0] != self.epoch:
            if not self.shuffle:
                files = list(range(len(self.files)))
            else:
                files = [int(i) for i in np.random.default_rng([self.seed, self.epoch]).permutation(len(self.files))]
            self._order = (self.epoch, files)
        return self._order[1]

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("epoch", "file_pos", "offset", "line_no", "row_no", "bad", "chunks")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, int(v))
        self._close()

    def _held_out(self, row: int) -> bool:
        return row % 1000 < self.permille

    def _wanted(self, row: int) -> bool:
        return self.split == "all" or self._held_out(row) == (self.split == "val")

    # --- chunks ---------------------------------------------------------------------------------------
    def next_rows(self) -> Rows | None:
        """This rank's rows of the next chunk; None at the end of an epoch (the train split then starts
        the next epoch; a partial last chunk is dropped for train, padded with weight 0 for val)."""
        need = self.batch_size * self.world_size
        parts: list[Rows] = []
        got = 0
        order = self.order()
        while got < need and self.file_pos < len(order):
            rows, n = self._take(order[self.file_pos], need - got, got)
            if rows is not None:
                parts.append(rows)
            got += n
            if got < need:  # the file is exhausted
                self._close()
                self.file_pos += 1
                self.offset = self.line_no = self.row_no = self.bad = 0
        if got == need:
            self.chunks += 1
            return _concat(parts)
        # end of the data: the same chunk on every rank
        if self.split != "train" and got > 0 and not getattr(self, "_padded", False):
            self._padded = True
            return _pad(_concat(parts) if parts else None, self.batch_size)
        self.end_epoch()
        return None

    def end_epoch(self) -> None:
        """Stop this epoch here (a limit on batches per epoch) and start the next one."""
        self._close()
        self._padded = False
        self.epoch += 1
        self.file_pos = self.chunks = 0
        self.offset = self.line_no = self.row_no = self.bad = 0

    def _take(self, index: int, n: int, chunk_start: int) -> tuple[Rows | None, int]:
        """Read up to ``n`` wanted rows of file ``index`` from the position; return this rank's share
        (chunk row ``chunk_start + k`` goes to rank ``(chunk_start + k) % world_size``) and how many were
        read."""
        raise NotImplementedError

    def _close(self) -> None:
        self._open_index = None

    def close(self) -> None:
        self._close()

    def _hash(self, ids: np.ndarray) -> np.ndarray:
        return ids if self.num_embeddings is None else hash_ids(ids, self.num_embeddings)

    def _own(self, chunk_start: int, n: int) -> list[int]:
        first = (self.rank - chunk_start) % self.world_size
        return list(range(first, n, self.world_size))


def _concat(parts: list[Rows]) -> Rows:
    if len(parts) == 1:
        return parts[0]
    return Rows(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("dense", "sparse", "labels", "weight")))


def _pad(rows: Rows | None, batch_size: int) -> Rows:
    have = 0 if rows is None else len(rows.labels)
    pad = batch_size - have
    filler = Rows(np.zeros((pad, INT_FEATURE_COUNT), np.float32), np.zeros((pad, CAT_FEATURE_COUNT), np.int64),
                  np.zeros(pad, np.float32), np.zeros(pad, np.float32))
    return filler if rows is None else _concat([rows, filler])


class CriteoTSVReader(_Stream):
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
        dense = np.array([[int(x) if x else 0 for x in r[1 : 1 + INT_FEATURE_COUNT]] for r in fields], dtype=np.int64)
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
    """Why a line is malformed, in words (the warning's reason)."""
    fields = line.rstrip(b"\r\n").split(b"\t")
    if len(fields) != FIELD_COUNT:
        return f"{len(fields)} fields, expected {FIELD_COUNT}"
    if fields[0] not in (b"0", b"1"):
        return f"label {fields[0][:20]!r} is not 0 or 1"
    for i, x in enumerate(fields[1 : 1 + INT_FEATURE_COUNT]):
        if x and not (x.lstrip(b"-").isdigit() and x.count(b"-") <= 1 and not x.endswith(b"-")):
            return f"dense feature I{i + 1} {x[:20]!r} is not an integer"
    for i, x in enumerate(fields[1 + INT_FEATURE_COUNT :]):
        try:
            int(x, 16) if x else 0
            if len(x) > 16 or not x.isalnum():
                raise ValueError
        except ValueError:
            return f"category C{i + 1} {x[:20]!r} is not a hex string"
    return "unreadable bytes"


class CriteoNpyReader(_Stream):
    """TorchRec's preprocessed layout (``day_N_dense.npy`` float32 already transformed, ``day_N_sparse.npy``
    int64 raw ids, ``day_N_labels.npy`` int32 ``[n, 1]``), memory-mapped; hashing happens on read.

    Chunks are read ``read_ahead`` at a time where the file holds that many more (one gather and one hash
    for all of them, then handed out one per call): a chunk read alone cost ~4x its standalone time inside
    a training loop (~0.2 ms per 256-row step, ~2% of a small DLRM's step: its code and data are cold after
    every forward and backward), most of it per-call overhead that a block pays once. The position still
    moves one chunk per call (``state_dict`` is the position after the chunks handed out, never after the
    ones read ahead) and the rows are the same, so resuming is unchanged."""

    #: rows per rank a read-ahead block holds at most (~4 MiB of inputs): ``read_ahead`` defaults to this
    #: over the batch size, within [1, 16]
    READ_AHEAD_ROWS = 16384

    def __init__(self, prefixes: Sequence[str], *, read_ahead: int | None = None, **kw: Any) -> None:
        super().__init__(prefixes, **kw)
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._sizes_column: np.ndarray | None = None  # the table sizes as [26, 1], against feature-major ids
        self.read_ahead = (max(1, min(16, self.READ_AHEAD_ROWS // max(self.batch_size, 1)))
                           if read_ahead is None else max(1, int(read_ahead)))
        self._ahead: deque[tuple[Rows, int]] = deque()  # chunks read ahead: (rows, the row position after it)
        # int64 work arrays kept between reads (the gathered raw ids, the hash's quotients): new ones of a
        # read-ahead block's size come from fresh pages every time, ~8 page faults per chunk
        self._work: list[np.ndarray | None] = [None, None]

    def _close(self) -> None:
        self._arrays = None
        self._open_index = None
        self._ahead.clear()

    def next_rows(self) -> Rows | None:
        if not self._ahead and self.read_ahead > 1:
            self._read_ahead()
        if self._ahead:
            rows, row = self._ahead.popleft()
            self.row_no = self.line_no = row
            self.chunks += 1
            return rows
        return super().next_rows()  # one chunk: across files, at the end of the data

    def _read_ahead(self) -> None:
        """Read the next ``read_ahead`` chunks at once if the current file holds them all, else nothing
        (the chunk-at-a-time path then takes the file's end)."""
        order = self.order()
        if self.file_pos >= len(order):
            return
        index = order[self.file_pos]
        self._open(index)
        total = len(self._arrays[2])
        need = self.batch_size * self.world_size
        ends, row = [], self.row_no
        for _ in range(self.read_ahead):
            row, got = self._advance(row, need, total)
            if got < need:
                return
            ends.append(row)
        start = self.row_no
        block, count = self._take(index, need * len(ends), 0, chunks=len(ends))
        if block is None or count != need * len(ends) or self.row_no != ends[-1]:  # cannot be: the same walk
            raise AssertionError(f"read-ahead of {self.files[index]} from row {start} went astray")
        self.row_no = self.line_no = start  # handed out one chunk at a time
        b = self.batch_size
        for j, end in enumerate(ends):
            rows = slice(j * b, (j + 1) * b)
            # block.sparse[j]: chunk j's feature-major [26, b] ids, what the KJT takes without a copy
            self._ahead.append((Rows(block.dense[rows], block.sparse[j].T, block.labels[rows], block.weight[rows]),
                                end))

    def _advance(self, row: int, n: int, total: int) -> tuple[int, int]:
        """Where ``_take`` of ``n`` rows from ``row`` leaves the position, and how many rows it reads."""
        count = 0
        while count < n:
            lo, hi = self._run(row, total)
            if lo >= total:
                return total, count
            hi = min(hi, lo + n - count)
            count += hi - lo
            row = hi
        return row, count

    def _open(self, index: int) -> None:
        if self._arrays is None or self._open_index != index:
            pre = self.files[index]
            # plain ndarray views of the maps: slicing an np.memmap runs its Python __getitem__ and
            # __array_finalize__ every time (the mmap stays alive through the views' base)
            self._arrays = tuple(np.asarray(np.load(f"{pre}_{part}.npy", mmap_mode="r"))
                                 for part in ("dense", "sparse", "labels"))
            self._open_index = index

    def _take(self, index: int, n: int, chunk_start: int, chunks: int = 1) -> tuple[Rows | None, int]:
        # ``chunks`` > 1 (a read-ahead block of that many whole chunks): the sparse ids come as one
        # feature-major ``[chunks, 26, batch_size]`` array.
        # The wanted rows of a file are runs (held-out rows come in blocks of ``permille`` per 1000), and
        # this rank's share of a run is every world_size-th row: strided slices of the memory maps, copied
        # once, with no index arrays built per step.
        self._open(index)
        dense, sparse, labels = self._arrays
        total = len(labels)
        first = (self.rank - chunk_start) % self.world_size
        mine: list[slice] = []  # this rank's rows, in chunk order
        count, row = 0, self.row_no
        while count < n:
            lo, hi = self._run(row, total)
            if lo >= total:
                row = total
                break
            hi = min(hi, lo + n - count)
            start = lo + (first - count) % self.world_size  # the first row of the run at a position ≡ first
            if start < hi:
                mine.append(slice(start, hi, self.world_size))
            count += hi - lo
            row = hi
        self.row_no = self.line_no = row
        if count == 0:
            return None, 0
        if not mine:
            return None, count
        y = _gather(labels, mine, np.float32)[:, 0]
        return Rows(_gather(dense, mine, np.float32), self._hash_feature_major(sparse, mine, chunks), y,
                    np.ones(len(y), np.float32)), count

    def _hash_feature_major(self, sparse: np.ndarray, slices: list[slice], chunks: int = 1) -> np.ndarray:
        """The table rows of ``slices`` of the raw ids, ``[rows, 26]`` as a view of a feature-major
        ``[26, rows]`` array: the KeyedJaggedTensor's layout (all rows of cat_0, then cat_1...), so
        :func:`azulite.workloads.dlrm.loop.to_batch` takes it without a copy. The ids are hashed
        in place on that copy (numpy's scalar division is vectorized over contiguous memory only: hashing
        the strided map straight into the output takes ~2x as long)."""
        if len(slices) == 1:
            ids = sparse[slices[0]]  # a view of the map
        else:
            n = sum(len(range(s.start, s.stop, s.step)) for s in slices)
            ids = np.concatenate([sparse[s] for s in slices], out=self._work_array(0, (n, sparse.shape[1])))
        # the one copy out of the map (always a copy: never the map itself), [chunks, 26, rows per chunk]
        ids = np.array(ids.reshape(chunks, -1, ids.shape[-1]).transpose(0, 2, 1), order="C")
        if self.num_embeddings is not None:
            if self._sizes_column is None:
                self._sizes_column = self.num_embeddings[:, None]
            hash_ids(ids, self._sizes_column, out=ids, scratch=self._work_array(1, ids.shape))
        return ids if chunks > 1 else ids[0].T

    def _work_array(self, i: int, shape: tuple[int, ...]) -> np.ndarray:
        """Work array ``i`` as an int64 array of ``shape`` (its contents are garbage: overwritten by the caller)."""
        n = int(np.prod(shape))
        buf = self._work[i]
        if buf is None or buf.size < n:
            buf = self._work[i] = np.empty(n, np.int64)
        return buf[:n].reshape(shape)

    def _run(self, row: int, total: int) -> tuple[int, int]:
        """The run of wanted rows ``[lo, hi)`` that holds ``row``, or the next one after it
        (``lo >= total``: none is left)."""
        if self.split == "all" or self.permille == 0:
            return row, total
        block, within = divmod(row, 1000)
        base = block * 1000
        if self.split == "train":
            return (base + self.permille if within < self.permille else row), min(total, base + 1000)
        if within >= self.permille:  # val: the next block's held-out rows
            base += 1000
            row = base
        return row, min(total, base + self.permille)


def _gather(arr: np.ndarray, slices: list[slice], dtype: Any = None) -> np.ndarray:
    """The rows of ``slices`` of a memory map as one new in-memory array (never a view of the file)."""
    if len(slices) == 1:
        return np.array(arr[slices[0]], dtype=dtype)
    return np.concatenate([arr[s] for s in slices]).astype(dtype or arr.dtype, copy=False)


def open_reader(dataset_path: str | os.PathLike, **kw: Any) -> _Stream:
    """The reader for whatever ``dataset_path`` holds (see :func:`list_files`)."""
    kind, files = list_files(dataset_path)
    return CriteoNpyReader(files, **kw) if kind == "npy" else CriteoTSVReader(files, **kw)
