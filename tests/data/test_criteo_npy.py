"""TSV -> npy: TorchRec's file names, dtypes and shapes, the readers' transform and bad-line rule, and an
npy reader that yields exactly the TSV reader's batches."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from azulite.data.criteo_npy import convert
from azulite.data.criteo_npy_reader import CriteoNpyReader
from azulite.data.criteo_reader import open_reader
from azulite.data.criteo_synth import best_auc, generate
from azulite.errors import DataError

N = [97] * 26


def test_converted_npy_yields_the_tsv_readers_batches(tmp_path):
    tsv = tmp_path / "tsv"
    generate(tsv, rows=700, files=2, seed=2, gzip_files=True)
    # a malformed line in the middle of day_1: skipped by both, so the rows still line up
    data = gzip.decompress((tsv / "day_1.gz").read_bytes()).split(b"\n")
    data.insert(300, b"1\tbroken")
    (tsv / "day_1.gz").write_bytes(gzip.compress(b"\n".join(data)))
    prefixes = convert(tsv, tmp_path / "npy", max_bad_fraction=0.01)
    assert [p.rsplit("/", 1)[1] for p in prefixes] == ["day_0", "day_1"]
    dense = np.load(tmp_path / "npy" / "day_1_dense.npy")
    sparse = np.load(tmp_path / "npy" / "day_1_sparse.npy")
    labels = np.load(tmp_path / "npy" / "day_1_labels.npy")
    assert (dense.dtype, dense.shape) == (np.float32, (700, 13))
    assert (sparse.dtype, sparse.shape) == (np.int64, (700, 26))
    assert (labels.dtype, labels.shape) == (np.int32, (700, 1))
    assert not list((tmp_path / "npy").glob(".convert-*"))  # no temporary left
    for split in ("train", "val"):
        kw = dict(rank=1, world_size=2, batch_size=25, num_embeddings_per_feature=N, validation_permille=150,
                  split=split, max_bad_fraction=0.01, seed=4)
        a, b = open_reader(tsv, **kw), open_reader(tmp_path / "npy", **kw)
        assert isinstance(b, CriteoNpyReader)
        n = 0
        while True:
            ra, rb = a.next_rows(), b.next_rows()
            if ra is None or rb is None:
                assert ra is None and rb is None
                break
            for f in ("dense", "sparse", "labels", "weight"):
                assert np.array_equal(getattr(ra, f), getattr(rb, f)), (split, n, f)
            n += 1
        assert n > 3
    # the generator's truth follows the rows (the broken line was no row)
    best = best_auc(tmp_path / "npy", 150)
    assert best is not None and 0.5 < best < 1 and best == best_auc(tsv, 150)


def test_conversion_keeps_the_bad_line_limit(tmp_path):
    (tmp_path / "day_0").write_text("0\tbad\n" * 3 + "\t".join(["1"] + ["1"] * 13 + ["0a"] * 26) + "\n")
    with pytest.raises(DataError) as e:
        convert(tmp_path / "day_0", tmp_path / "out")
    assert "day_0" in str(e.value) and "malformed" in str(e.value)
    assert not list((tmp_path / "out").glob("*.npy"))  # nothing half-written


def test_a_file_of_no_rows_is_refused(tmp_path):
    # converted as "0 rows", rc 0: the empty day broke training later
    (tmp_path / "day_0").write_text("")
    with pytest.raises(DataError, match="holds no Criteo rows"):
        convert(tmp_path / "day_0", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # the folder it made for it is gone too


def test_the_synth_tool_says_a_mistake_without_a_traceback(tmp_path, capsys):
    from azulite.data.criteo_synth import main

    assert main([str(tmp_path / "s"), "--rows", "0"]) == 2
    (tmp_path / "f").write_text("")
    assert main([str(tmp_path / "f"), "--rows", "10"]) == 2  # was FileExistsError's traceback
    err = capsys.readouterr().err
    assert "rows=0 files=1: both must be >= 1" in err and "is a file, not a folder" in err


def test_the_converter_names_its_positional_argument_not_the_trainers_flag(tmp_path, capsys):
    from azulite.data.criteo_npy import main

    assert main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err  # on stderr (it was printed to stdout)
    assert err.startswith(f"error: IN_FILE_OR_FOLDER: dataset path '{tmp_path / 'nope'}' does not exist\n")
    assert "--dataset_path" not in err and "fix: pass a Criteo TSV file (plain or .gz) or a folder of them" in err
    # an npy folder given as the input: said, not FileNotFoundError's traceback
    generate(tmp_path / "tsv", rows=20, files=1, seed=0)
    assert main([str(tmp_path / "tsv"), str(tmp_path / "npy")]) == 0
    assert main([str(tmp_path / "npy"), str(tmp_path / "again")]) == 2
    assert "already holds TorchRec's npy layout" in capsys.readouterr().err
