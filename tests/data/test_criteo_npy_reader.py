"""The npy reader: the split and sharding rule against whole arrays, its feature-major ids against the TSV
reader's, and its read-ahead against the chunk-at-a-time walk (rows, positions, a restore mid-block)."""

from __future__ import annotations

import numpy as np
import pytest

from azulite.data.criteo_npy import convert
from azulite.data.criteo_npy_reader import CriteoNpyReader
from azulite.data.criteo_reader import open_reader
from azulite.data.criteo_synth import generate
from azulite.errors import DataError

N = [97] * 26


def _npy_day(folder, name: str, n: int, rng) -> None:
    folder.mkdir(exist_ok=True)
    np.save(folder / f"{name}_dense.npy", rng.random((n, 13), dtype=np.float32))
    np.save(folder / f"{name}_sparse.npy", rng.integers(0, 2**40, (n, 26), dtype=np.int64))
    np.save(folder / f"{name}_labels.npy", rng.integers(0, 2, (n, 1), dtype=np.int32))


def _expected_chunks(folder, names, split, permille, world_size, batch_size, rank):
    """This rank's rows of every chunk, from whole arrays and the rule as the reader's docstring states it."""
    dense, sparse, labels = [], [], []
    for name in names:
        d, s, y = (np.load(folder / f"{name}_{k}.npy") for k in ("dense", "sparse", "labels"))
        i = np.arange(len(y))
        keep = np.ones(len(y), bool) if split == "all" else (i % 1000 < permille) == (split == "val")
        dense.append(d[keep]), sparse.append(s[keep] % np.array(N)), labels.append(y[keep, 0].astype(np.float32))
    dense, sparse, labels = np.concatenate(dense), np.concatenate(sparse), np.concatenate(labels)
    need = world_size * batch_size
    out = []
    for c in range(0, len(labels), need):
        rows = slice(c + rank, c + need, world_size)
        d, s, y = dense[rows], sparse[rows], labels[rows]
        w = np.ones(len(y), np.float32)
        if c + need > len(labels):  # the partial last chunk: dropped for train, padded for val
            if split == "train":
                break
            pad = batch_size - len(y)
            d, s = np.concatenate([d, np.zeros((pad, 13), np.float32)]), np.concatenate([s, np.zeros((pad, 26), np.int64)])
            y, w = np.concatenate([y, np.zeros(pad, np.float32)]), np.concatenate([w, np.zeros(pad, np.float32)])
        out.append((d, s, y, w))
    return out


@pytest.mark.parametrize("split,permille,world_size,batch_size", [
    ("train", 150, 2, 256), ("train", 0, 3, 7), ("train", 999, 2, 1), ("val", 150, 3, 50), ("val", 1, 2, 5),
    ("all", 0, 4, 333), ("train", 100, 1, 600), ("train", 100, 3, 301), ("val", 150, 3, 70),
])
def test_npy_reader_rows_follow_the_split_and_sharding_rule(tmp_path, split, permille, world_size, batch_size):
    rng = np.random.default_rng(7)
    _npy_day(tmp_path, "day_0", 2500, rng)
    _npy_day(tmp_path, "day_1", 1701, rng)
    for rank in range(world_size):
        r = CriteoNpyReader([str(tmp_path / "day_0"), str(tmp_path / "day_1")], rank=rank, world_size=world_size,
                            batch_size=batch_size, num_embeddings_per_feature=N, split=split,
                            validation_permille=permille, shuffle_files=False)
        want = _expected_chunks(tmp_path, ["day_0", "day_1"], split, permille, world_size, batch_size, rank)
        got = []
        while (rows := r.next_rows()) is not None:
            got.append(rows)
        assert len(got) == len(want) > 0
        for k, (g, w) in enumerate(zip(got, want)):
            for f, expected in zip(("dense", "sparse", "labels", "weight"), w):
                value = getattr(g, f)
                assert value.dtype == expected.dtype and np.array_equal(value, expected), (rank, k, f)
                assert value.flags.writeable and not isinstance(value.base, np.memmap)  # a copy, not the file
        assert r.epoch == 1 and r.chunks == 0


def test_npy_rows_are_feature_major_and_match_tsv_with_mixed_table_sizes(tmp_path):
    # mixed sizes hash with np.remainder, uniform ones with the scalar division: both must give the TSV
    # reader's rows; the npy reader's sparse ids are a view of a feature-major array (the KJT's layout),
    # writable and in memory (never the read-only map)
    generate(tmp_path / "tsv", rows=600, files=1, seed=3)
    convert(tmp_path / "tsv", tmp_path / "npy")
    sizes = [7, 100] + [1000] * 12 + [2**33] * 12
    kw = dict(rank=0, world_size=2, batch_size=32, num_embeddings_per_feature=sizes, validation_permille=100)
    a, b = open_reader(tmp_path / "tsv", **kw), open_reader(tmp_path / "npy", **kw)
    n = 0
    while (rb := b.next_rows()) is not None:
        ra = a.next_rows()
        assert np.array_equal(ra.sparse, rb.sparse)
        assert rb.sparse.T.flags.c_contiguous and rb.sparse.flags.writeable
        n += 1
    assert a.next_rows() is None and n > 5


@pytest.mark.parametrize("split,permille,world_size,batch_size,read_ahead", [
    ("train", 150, 2, 64, 5), ("val", 150, 3, 20, 4), ("all", 0, 1, 100, 16), ("train", 990, 2, 1, 3),
])
def test_read_ahead_hands_out_the_same_rows_and_positions_and_resumes_mid_block(
        tmp_path, split, permille, world_size, batch_size, read_ahead):
    rng = np.random.default_rng(11)
    _npy_day(tmp_path, "day_0", 2500, rng)
    _npy_day(tmp_path, "day_1", 1701, rng)
    files = [str(tmp_path / "day_0"), str(tmp_path / "day_1")]
    kw = dict(rank=world_size - 1, world_size=world_size, batch_size=batch_size, num_embeddings_per_feature=N,
              split=split, validation_permille=permille, seed=5)
    one, ahead = CriteoNpyReader(files, read_ahead=1, **kw), CriteoNpyReader(files, read_ahead=read_ahead, **kw)
    expected, states, kept, blocks = [], [], [], 0
    while one.epoch < 2:  # two epochs: shuffled file order, file ends, the val split's padded last chunk
        want, got = one.next_rows(), ahead.next_rows()
        blocks += len(ahead._ahead) == read_ahead - 1  # a block was just read
        assert ahead.state_dict() == one.state_dict()
        expected.append(want), states.append(one.state_dict()), kept.append(got)
        if want is None:
            assert got is None
            continue
        for f in ("dense", "sparse", "labels", "weight"):
            assert np.array_equal(getattr(got, f), getattr(want, f)) and getattr(got, f).dtype == getattr(want, f).dtype
        assert got.sparse.T.flags.c_contiguous or not want.sparse.T.flags.c_contiguous  # the KJT's layout
    assert blocks > 2  # the read-ahead path ran, not only the chunk-at-a-time one
    for got, want in zip(kept, expected):  # rows handed out earlier were not overwritten by later reads
        assert got is want is None or np.array_equal(got.sparse, want.sparse) and np.array_equal(got.dense, want.dense)
    # restored from a position inside a block (not a block boundary), it continues exactly
    k = next(i for i, s in enumerate(states) if expected[i] is not None and i % read_ahead == read_ahead // 2 and i > 3)
    resumed = CriteoNpyReader(files, read_ahead=read_ahead, **kw)
    resumed.next_rows()  # a block read ahead from the start, which the restore must drop
    resumed.load_state_dict(states[k])
    for want in expected[k + 1:]:
        got = resumed.next_rows()
        assert (got is None) == (want is None)
        if want is not None:
            assert np.array_equal(got.sparse, want.sparse) and np.array_equal(got.dense, want.dense)


@pytest.mark.parametrize("read_ahead", [1, 16])
def test_npy_days_of_fewer_rows_than_one_step_are_an_error_not_an_empty_epoch(tmp_path, read_ahead):
    _npy_day(tmp_path, "day_0", 3, np.random.default_rng(0))
    _npy_day(tmp_path, "day_1", 4, np.random.default_rng(1))
    r = open_reader(tmp_path, rank=0, world_size=2, batch_size=4, num_embeddings_per_feature=N, read_ahead=read_ahead)
    with pytest.raises(DataError) as e:
        r.next_rows()
    assert e.value.message == (f"0 training steps from '{tmp_path}': its 7 training row(s) are fewer than one step "
                               "takes (8: --batch_size 4 x 2 ranks)")
    assert e.value.fix == "give more rows, or a --batch_size of at most 3"
