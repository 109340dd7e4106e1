"""What both Criteo readers share: the rows of a chunk, the dataset's files, and the walk over them.

Every rank walks the same files in the same order and cuts the same *chunks* of ``world_size x
batch_size`` rows; row ``k`` of a chunk belongs to rank ``k % world_size``. So every step gives every rank
exactly ``batch_size`` rows, all ranks see the end of the data at the same chunk (a sharded model's
collectives need every rank in every step) without talking to each other, and the global batch is the
same rows whatever the world size.

The position — epoch, file, byte offset, line and row numbers — is a small ``state_dict``, saved with the
checkpoint and restored by seeking (a gzip file is decompressed up to the offset again). The file order
is shuffled per epoch with ``numpy.random.default_rng([seed, epoch])``: the epoch is the RNG state.

Held-out rows: with ``validation_permille = v``, row ``i`` of a file (counting only well-formed rows) is
held out when ``i % 1000 < v``; the train split reads the rest. The npy converter keeps well-formed rows
only, so both formats hold out the same rows.

The formats' readers: :mod:`azulite.data.criteo_reader` (TSV, and :func:`~azulite.data.criteo_reader.open_reader`,
which picks one) and :mod:`azulite.data.criteo_npy_reader` (TorchRec's npy layout).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from azulite.data.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT, hash_ids
from azulite.errors import DataError


@dataclass
class Rows:
    """This rank's rows of one chunk: model inputs after preprocessing. ``weight`` is 0 for padding."""

    dense: np.ndarray  # float32 [B, 13], log(1 + max(x, 0))
    sparse: np.ndarray  # int64 [B, 26], table rows
    labels: np.ndarray  # float32 [B]
    weight: np.ndarray  # float32 [B]: 1 real row, 0 padding (the validation split's last chunk)


def list_files(dataset_path: str | os.PathLike, *, where: str = "--dataset_path") -> tuple[str, list[str]]:
    """``("npy", [day prefixes])`` for a folder of ``day_N_{dense,sparse,labels}.npy``, else ``("tsv",
    [files])`` for one TSV file or a folder of them (sorted; ``.gz`` read as gzip). ``where``: the argument
    as the user gave it, for the errors (a trainer's flag, a tool's positional argument)."""
    p = Path(dataset_path)
    if not p.exists():
        raise DataError(f"dataset path {str(p)!r} does not exist", where=where,
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
        raise DataError(f"folder {str(p)!r} holds no data files", where=where,
                        fix="put Criteo TSV files (day_0, day_1.gz, ...) or day_N_*.npy files in it")
    return "tsv", files


def _natural(s: str) -> tuple:
    import re

    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s))


class ChunkStream:
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
        #: what the error of an epoch with no step names (open_reader: the dataset path as given)
        self.source = self.files[0] if len(self.files) == 1 else f"{len(self.files)} files ({self.files[0]}, ...)"
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
        if self.split == "train" and self.chunks == 0:  # a whole epoch without one step
            raise self._no_step(got)
        if self.split != "train" and got > 0 and not getattr(self, "_padded", False):
            self._padded = True
            return _pad(_concat(parts) if parts else None, self.batch_size)
        self.end_epoch()
        return None

    def _no_step(self, rows: int) -> DataError:
        """A train split that gives no step: trained on, it "succeeded" with an untrained model, committed
        as a checkpoint that exports. ``rows``: the epoch's training rows (all in the unfinished chunk)."""
        need, ranks = self.batch_size * self.world_size, f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        held = (f" (not counting the rows --validation_fraction holds out: row i of each file when i % 1000 < "
                f"{self.permille})" if self.permille else "")
        if rows == 0:
            return DataError(f"0 training rows from {self.source!r}: no well-formed Criteo row to train on{held}",
                             where="--dataset_path",
                             fix="check the files hold Criteo TSV rows (label, 13 integers, 26 hex categories, "
                                 "tab-separated; an empty or cut download?)")
        most = rows // self.world_size
        return DataError(
            f"0 training steps from {self.source!r}: its {rows} training row(s) are fewer than one step takes "
            f"({need}: --batch_size {self.batch_size} x {ranks}){held}", where="--dataset_path",
            fix=f"give more rows, or a --batch_size of at most {most}" if most else "give more rows")

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
