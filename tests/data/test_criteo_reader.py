"""The Criteo readers against hand-written lines: empty fields, negative integers, malformed lines, gzip
(whole and truncated), rank sharding into equal batches, and resuming from a saved position."""

from __future__ import annotations

import gzip
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from azulite.data.criteo import LINE_RE, hash_categories, parse_line, transform_dense
from azulite.data.criteo_reader import CriteoTSVReader, describe_bad_line, list_files, open_reader
from azulite.data.criteo_synth import generate
from azulite.errors import DataError

N = [7] * 13 + [1000] * 13


def line(label="1", dense=None, cats=None) -> str:
    dense = dense if dense is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i * 16 + 3:08x}" for i in range(26)]
    return "\t".join([label, *dense, *cats])


def write(path: Path, lines: list[str], gz: bool = False) -> Path:
    data = ("\n".join(lines) + "\n").encode()
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def reader(path, **kw) -> CriteoTSVReader:
    base = dict(rank=0, world_size=1, batch_size=1, num_embeddings_per_feature=N, shuffle_files=False)
    return open_reader(path, **{**base, **kw})


def test_empty_fields_and_negative_integers_are_preprocessed_by_the_shared_rule(tmp_path):
    dense = ["", "-3", "0", "5", "-", *[""] * 8]  # a lone "-" is 0, as serving reads it (was a ValueError)
    cats = ["", "0000000a", "FFFFFFFF", *[f"{i:08x}" for i in range(23)]]
    r = reader(write(tmp_path / "day_0", [line("0", dense, cats)]))
    rows = r.next_rows()
    assert rows.labels.tolist() == [0.0] and rows.weight.tolist() == [1.0]
    # log(1 + max(x, 0)); empty -> 0; negative -> 0
    assert rows.dense[0, :4].tolist() == pytest.approx([0.0, 0.0, 0.0, math.log(6)])
    assert rows.dense.dtype == np.float32 and rows.sparse.dtype == np.int64
    # int(hex, 16) % table size; empty -> id 0
    assert rows.sparse[0, :3].tolist() == [0, 10 % 7, 0xFFFFFFFF % 7]
    assert rows.sparse[0].tolist() == hash_categories(cats, N).tolist()
    assert rows.dense[0].tolist() == transform_dense(dense).tolist()
    assert r.next_rows() is None  # one row, one epoch


def test_malformed_lines_are_skipped_with_a_warning_naming_file_and_line(tmp_path, caplog):
    lines = [
        line("1"),
        "\t".join(line("0").split("\t")[:39]),                    # 39 fields
        line("1", cats=["zzzzzzzz", *[""] * 25]),                    # non-hex category
        line("0", dense=["1.5", *[""] * 12]),                        # non-integer dense value
        line("2"),                                                   # label neither 0 nor 1
        line("0", dense=["-4", *["7"] * 12], cats=[""] * 26),
    ]
    path = write(tmp_path / "day_0", lines)
    r = reader(path, max_bad_fraction=0.9, batch_size=2)
    with caplog.at_level(logging.WARNING, logger="azulite.data.criteo_reader"):
        rows = r.next_rows()
    assert rows.labels.tolist() == [1.0, 0.0]
    assert rows.dense[1].tolist() == transform_dense(["-4", *["7"] * 12]).tolist()
    msgs = [rec.getMessage() for rec in caplog.records]
    assert len(msgs) == 4
    assert f"{path}:2: malformed Criteo line skipped (39 fields, expected 40)" in msgs[0]
    assert f"{path}:3:" in msgs[1] and "C1 b'zzzzzzzz' is not a hex string" in msgs[1]
    assert f"{path}:4:" in msgs[2] and "I1 b'1.5' is not an integer" in msgs[2]
    assert f"{path}:5:" in msgs[3] and "label b'2'" in msgs[3]
    assert r.bad == 4


@pytest.mark.parametrize("dense, cats, reason", [
    # an empty category is id 0, legitimately: the bad one after it is named (was "C6 b'' is not a hex string")
    (None, ["0a"] * 5 + [""] + ["0b"] * 19 + ["ZZZZzzzz"], "category C26 b'ZZZZzzzz' is not a hex string"),
    (None, [""] * 25 + ["1" * 17], "category C26 b'11111111111111111' is longer than 16 hex digits"),
    (None, [""] * 3 + ["+1a"] + [""] * 22, "category C4 b'+1a' is not a hex string"),
    (["", "", "+5", *[""] * 10], None, "dense feature I3 b'+5' is not an integer"),
    (["", "--1", *[""] * 11], None, "dense feature I2 b'--1' is not an integer"),
])
def test_a_malformed_line_names_the_field_that_breaks_the_rule_not_an_empty_one(tmp_path, caplog, dense, cats,
                                                                                  reason):
    bad = line("1", dense=dense, cats=cats)
    assert LINE_RE.fullmatch(bad.encode() + b"\n") is None
    assert describe_bad_line(bad.encode() + b"\n") == reason
    path = write(tmp_path / "day_0", [line("0"), bad, line("1")])
    with caplog.at_level(logging.WARNING, logger="azulite.data.criteo_reader"):
        assert reader(path, max_bad_fraction=0.5, batch_size=2).next_rows() is not None
    assert [rec.getMessage() for rec in caplog.records] == [f"{path}:2: malformed Criteo line skipped ({reason})"]


def test_more_malformed_lines_than_the_limit_is_a_clear_error(tmp_path):
    path = write(tmp_path / "day_0", [line("1")] * 8 + ["1\tnot\ta\tcriteo\tline"] * 2)
    r = reader(path, max_bad_fraction=0.1, batch_size=4)
    with pytest.raises(DataError) as e:
        while r.next_rows() is not None:
            pass
    assert str(path) in str(e.value) and "2 of the first 10 lines are malformed" in str(e.value)
    assert "--max_bad_lines_fraction" in str(e.value)
    # the default limit (0.1%) tolerates none in 10 lines; 20% does
    r = reader(path, max_bad_fraction=0.2, batch_size=4)
    assert r.next_rows() is not None and r.next_rows() is not None and r.next_rows() is None


def test_gzip_is_read_and_a_truncated_gzip_names_the_file(tmp_path):
    lines = [line(str(i % 2)) for i in range(200)]
    (tmp_path / "a").mkdir()
    plain = reader(write(tmp_path / "a" / "day_0", lines), batch_size=200)
    gz_path = write(tmp_path / "day_0.gz", lines, gz=True)
    gz = reader(gz_path, batch_size=200)
    a, b = plain.next_rows(), gz.next_rows()
    assert np.array_equal(a.sparse, b.sparse) and np.array_equal(a.labels, b.labels)
    cut = tmp_path / "cut" / "day_1.gz"
    cut.parent.mkdir()
    cut.write_bytes(gz_path.read_bytes()[: len(gz_path.read_bytes()) // 2])
    with pytest.raises(DataError) as e:
        reader(cut, batch_size=200).next_rows()
    assert str(cut) in str(e.value) and "truncated or corrupt" in str(e.value)


def test_a_missing_dataset_path_is_a_clear_error(tmp_path):
    with pytest.raises(DataError) as e:
        list_files(tmp_path / "nope")
    assert "does not exist" in str(e.value) and e.value.where == "--dataset_path"


@pytest.mark.parametrize("lines, kw, message, fix", [
    ([], {}, "0 training rows from '{path}': no well-formed Criteo row to train on", "check the files hold Criteo"),
    (["", "", ""], {}, "0 training rows from '{path}': no well-formed Criteo row to train on", "an empty or cut"),
    ([line("1")] * 5, {"batch_size": 16},
     "0 training steps from '{path}': its 5 training row(s) are fewer than one step takes (16: --batch_size 16 x "
     "1 rank)", "give more rows, or a --batch_size of at most 5"),
    ([line("1")] * 5, {"batch_size": 2, "world_size": 3},
     "0 training steps from '{path}': its 5 training row(s) are fewer than one step takes (6: --batch_size 2 x "
     "3 ranks)", "give more rows, or a --batch_size of at most 1"),
    ([line("1")] * 5, {"validation_permille": 100}, "0 training rows from '{path}': no well-formed Criteo row to "
     "train on (not counting the rows --validation_fraction holds out: row i of each file when i % 1000 < 100)",
     "check the files"),
])
def test_a_train_split_of_no_step_is_an_error_not_an_empty_epoch(tmp_path, lines, kw, message, fix):
    """An empty file, one of blank lines, fewer rows than a step: the run "succeeded" (exit 0) with an untrained
    model and committed it as a checkpoint that exported."""
    (tmp_path / "d").mkdir()
    path = tmp_path / "d"
    (path / "day_0").write_text("".join(f"{ln}\n" for ln in lines))
    r = reader(path, **kw)
    with pytest.raises(DataError) as e:
        r.next_rows()
    assert e.value.message == message.format(path=path) and e.value.where == "--dataset_path"
    assert e.value.exit_code == 2 and fix in e.value.fix
    # the held-out split of the same rows pads its one chunk: the evaluation's rows, not an error
    if kw.get("validation_permille"):
        held = chunks(reader(path, **kw, split="val"))
        assert sum(float(c.weight.sum()) for c in held) == 5


def test_line_rule_is_the_parse_rule():
    assert parse_line(line().encode()) is not None
    for bad in ("+1" + line()[1:], line(dense=[" 5", *[""] * 12]), line(dense=["1_0", *[""] * 12]),
                line(cats=["0" * 17, *[""] * 25])):
        assert LINE_RE.fullmatch(bad.encode()) is None and parse_line(bad.encode()) is None
    # what the rule lets through parses: a lone "-" is 0 (parse_line raised ValueError on it)
    assert parse_line(line(dense=["-", *["2"] * 12]).encode())[1] == [0, *[2] * 12]


def chunks(r) -> list:
    out = []
    while (rows := r.next_rows()) is not None:
        out.append(rows)
    return out


@pytest.mark.parametrize("gz", [False, True])
def test_ranks_get_equal_disjoint_shares_of_the_same_global_batches(tmp_path, gz):
    generate(tmp_path, rows=333, files=2, seed=3, gzip_files=gz)
    kw = dict(batch_size=10, validation_permille=100, seed=5, shuffle_files=True)
    single = chunks(reader(tmp_path, **kw, world_size=1))
    ranks = [chunks(reader(tmp_path, **{**kw, "batch_size": 5}, rank=r, world_size=2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(single) == 2 * (333 - 100) // 10  # rows 0-99 held out; the last partial chunk dropped
    for whole, r0, r1 in zip(single, *ranks):
        assert len(r0.labels) == len(r1.labels) == 5
        inter = np.empty_like(whole.sparse)
        inter[0::2], inter[1::2] = r0.sparse, r1.sparse
        assert np.array_equal(inter, whole.sparse)  # row k of a chunk goes to rank k % world_size


def test_validation_split_is_disjoint_and_its_last_chunk_is_padded(tmp_path):
    generate(tmp_path, rows=1500, files=1, seed=4)
    kw = dict(batch_size=64, validation_permille=100, world_size=2)
    val = [chunks(reader(tmp_path, **kw, rank=r, split="val")) for r in range(2)]
    real = sum(int(c.weight.sum()) for rank in val for c in rank)
    assert real == 200  # rows 0-99 and 1000-1099
    assert len(val[0]) == len(val[1]) and all(len(c.labels) == 64 for rank in val for c in rank)
    assert val[1][-1].weight[-1] == 0  # padding


@pytest.mark.parametrize("gz", [False, True])
def test_a_reader_restored_from_its_state_continues_exactly(tmp_path, gz):
    generate(tmp_path, rows=400, files=3, seed=6, gzip_files=gz)
    kw = dict(batch_size=16, validation_permille=50, rank=1, world_size=2, seed=9)
    full = reader(tmp_path, **kw)
    expected = [full.next_rows() for _ in range(60)]  # crosses files and an epoch boundary
    part = reader(tmp_path, **kw)
    for _ in range(23):
        part.next_rows()
    state = part.state_dict()
    assert state["file_pos"] > 0 and state["offset"] > 0
    resumed = reader(tmp_path, **kw)
    resumed.load_state_dict(state)
    for want in expected[23:]:
        got = resumed.next_rows()
        if want is None:
            assert got is None
            continue
        assert np.array_equal(got.sparse, want.sparse) and np.array_equal(got.dense, want.dense)
        assert np.array_equal(got.labels, want.labels)
    assert resumed.epoch >= 1
