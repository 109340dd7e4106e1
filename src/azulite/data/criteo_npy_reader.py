"""Streaming, rank-sharded, resumable reader of TorchRec's preprocessed Criteo layout
(``day_N_{dense,sparse,labels}.npy``), memory-mapped and read ahead; the chunking, the split and the
position are :class:`~azulite.data.criteo_stream.ChunkStream`'s, the same as the TSV reader's, so both
formats hand a rank the same rows."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from azulite.data.criteo import hash_ids
from azulite.data.criteo_stream import ChunkStream, Rows


class CriteoNpyReader(ChunkStream):
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
