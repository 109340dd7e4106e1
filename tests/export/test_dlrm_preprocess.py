"""The DLRM pipeline's parse step (the served model.py): the vectorised path reads exactly what the field-by-
field reference reads, takes the batch itself for well-formed rows (a path that always fell back would pass
the equality trivially), leaves every doubt to the reference (whose error names the row and field), and
the Triton model parses a dynamic batch as one while failing only the request that sent a bad row. The
one-step model (parse + the ONNX graph in one execute) scores a dynamic batch in one session run, each
request's scores its own, and fails only the request that sent a bad row."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from azulite.export import dlrm_preprocess as pre
from azulite.export.dlrm import PREPROCESS_MODEL_PY, SCORING_MODEL_PY, sample_rows
from azulite.serve.backends import pb_utils

ANCHOR_PYTHON = Path(__file__).resolve().parents[2] / ".cache" / "anchors" / "venv" / "bin" / "python"


def checked_or_error(rows):
    try:
        return pre.parse_rows_checked(rows)
    except ValueError as e:
        return str(e)


def parsed_or_error(rows):
    try:
        return pre.parse_rows(rows)
    except ValueError as e:
        return str(e)


def assert_same(got, want):
    if isinstance(want, str):
        assert got == want
        return
    assert not isinstance(got, str), got
    for g, w in zip(got, want):
        assert g.dtype == np.int64 and g.flags.c_contiguous and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def unlabelled(rows: np.ndarray) -> np.ndarray:
    return np.array([r.split(b"\t", 1)[1] for r in rows.reshape(-1)], dtype=object)


@pytest.mark.parametrize("n", [4, 5, 64, 257])
def test_fast_path_reads_well_formed_batches_as_the_reference(n):
    rows = sample_rows(n, seed=n).reshape(-1)
    # with labels, without, mixed; lines still ending as read from a file; bytearrays
    mixed = rows.copy()
    mixed[::2] = unlabelled(rows)[::2]
    ended = np.array([r + (b"\r\n" if i % 3 else b"\n") for i, r in enumerate(rows)], dtype=object)
    as_bytearray = np.array([bytearray(r) for r in rows], dtype=object)
    for batch in (rows, unlabelled(rows), mixed, ended, as_bytearray, rows.reshape(n, 1)):
        fast = pre.parse_rows_fast(np.asarray(batch, dtype=object).reshape(-1))
        assert fast is not None
        assert_same(fast, pre.parse_rows_checked(batch))
        assert_same(pre.parse_rows(batch), pre.parse_rows_checked(batch))


def test_extreme_values_and_empty_fields():
    dense = ["", "-", "-0", "0", "007", "-5", "999999999999999999", "-999999999999999999", "1", "", "", "", "42"]
    cats = ["", "0", "a", "F", "00000000deadBEEF", "7fffffffffffffff", "ffffffff", "1", *[""] * 18]
    row = "\t".join(dense + cats).encode()
    rows = np.array([row, b"1\t" + row, row, row], dtype=object)
    fast = pre.parse_rows_fast(rows)
    assert fast is not None
    assert_same(fast, pre.parse_rows_checked(rows))
    assert fast[0][0, :8].tolist() == [0, 0, 0, 0, 7, -5, 999999999999999999, -999999999999999999]
    assert fast[1][0, :6].tolist() == [0, 0, 10, 15, 0xDEADBEEF, (1 << 63) - 1]


def test_values_at_the_exact_float_limit_and_past_it():
    # fields up to 15 decimal / 13 hex digits are summed in float64 (exact below 2**53), longer ones in int64
    dense = ["999999999999999", "-999999999999999", "9999999999999999", "100000000000001", "1000000000000001",
             "9007199254740993", *[""] * 7]
    cats = ["fffffffffffff", "1fffffffffffff", "ffffffffffffff", "10000000000001", "20000000000001", *[""] * 21]
    row = "\t".join(dense + cats).encode()
    rows = np.array([row] * 4, dtype=object)
    fast = pre.parse_rows_fast(rows)
    assert fast is not None
    assert_same(fast, pre.parse_rows_checked(rows))
    assert fast[0][0, :6].tolist() == [int(v) for v in dense[:6]]
    assert fast[1][0, :5].tolist() == [int(v, 16) for v in cats[:5]]


def test_rows_whose_fields_add_up_but_differ_are_found():
    # 39 tabs a row on average, but one row short and one long (or a labelled row beside a short one): the
    # rows' count of fields is checked row by row, not only in total
    rows = unlabelled(sample_rows(4, seed=5).reshape(-1))
    short, long_ = rows.copy(), rows.copy()
    short[1] = short[1].rsplit(b"\t", 1)[0]  # 38 fields
    long_[1] = short[1]
    long_[2] = b"1\t" + rows[2]  # 40 fields
    labelled = rows.copy()
    labelled[0] = b"0\t" + rows[0]  # 40 fields beside a 38-field row: 39 a row on average
    labelled[3] = short[1]
    over = np.array([b"0\t" + r for r in rows], dtype=object)  # 40 a row on average: 41, 39, 40, 40
    over[0] = b"1\t" + over[0]
    over[1] = rows[1]
    for batch, message, per_row in [(long_, "row 1: 38 tab-separated fields", pre.FEATURES),
                                    (labelled, "row 3: 38 tab-separated fields", pre.FEATURES),
                                    (over, "row 0: 41 tab-separated fields", pre.FEATURES + 1)]:
        assert sum(r.count(b"\t") + 1 for r in batch) == per_row * len(batch)
        assert pre.parse_rows_fast(batch) is None
        with pytest.raises(ValueError, match=message):
            pre.parse_rows(batch)


def test_every_doubt_goes_to_the_reference_and_its_error():
    good = sample_rows(6, seed=3).reshape(-1)
    fields = good[2].split(b"\t")

    def with_field(index: int, value: bytes) -> np.ndarray:
        rows = good.copy()
        rows[2] = b"\t".join([*fields[:index], value, *fields[index + 1:]])
        return rows

    for index, value, message in [
        (1, b"+5", "row 2, I1: '+5' is not a decimal integer"),
        (2, b"--1", "row 2, I2: '--1' is not a decimal integer"),
        (3, b" 1", "row 2, I3: ' 1' is not a decimal integer"),
        (4, "٣".encode(), "row 2, I4: '٣' is not a decimal integer"),
        (5, b"9223372036854775808", "row 2, I5: '9223372036854775808' does not fit in int64"),
        (6, b"-9223372036854775809", "row 2, I6: '-9223372036854775809' does not fit in int64"),
        (14, b"xyz", "row 2, C1: 'xyz' is not a hex category id"),
        (15, b"8000000000000000", "row 2, C2: '8000000000000000' does not fit in int64"),
        (16, b"00000000000000001", "row 2, C3: '00000000000000001' is not a hex category id"),
        (17, b"a\xffb", "row 2, C4: 'a\ufffdb' is not a hex category id"),
        (18, b"1\r2", "row 2, C5: '1\\r2' is not a hex category id"),
        (19, b"1\t2", "row 2: 41 tab-separated fields"),
    ]:
        rows = with_field(index, value)
        assert pre.parse_rows_fast(rows) is None, value
        with pytest.raises(ValueError) as e:
            pre.parse_rows(rows)
        assert str(e.value).startswith(message), str(e.value)
    # values the fast path leaves to the reference, which reads them (19 digits, leading zeros)
    for value in (b"9223372036854775807", b"-9223372036854775808", b"0000000000000000000012"):
        rows = with_field(1, value)
        assert pre.parse_rows_fast(rows) is None
        assert pre.parse_rows(rows)[0][2, 0] == int(value)
    for rows, message in [(np.array([b""] * 4, dtype=object), "row 0: 1 tab-separated fields"),
                          (np.array(["1\t2"] * 4, dtype=object), "row 0: 2 tab-separated fields")]:
        with pytest.raises(ValueError, match=message):
            pre.parse_rows(rows)


_ALPHABET = [b"0", b"7", b"9", b"a", b"F", b"g", b"-", b"+", b" ", b"\t", b"\r", b"\n", b"\xff", b"",
             b"8000000000000000"]


def fuzz(trials: int, seed: int) -> tuple[int, int]:
    """Rows mutated at random (a field replaced, extended, emptied; a separator added or removed) in
    batches; parse_rows must answer as the reference: the same arrays or the same error."""
    rng = np.random.default_rng(seed)
    fast_taken = errors = 0
    for _ in range(trials):
        n = int(rng.integers(4, 12))
        rows = sample_rows(n, seed=int(rng.integers(1 << 30))).reshape(-1)
        for _ in range(int(rng.integers(0, 3))):
            i = int(rng.integers(n))
            fields = rows[i].split(b"\t")
            j = int(rng.integers(len(fields)))
            kind = int(rng.integers(4))
            if kind == 0:
                fields[j] = b"".join(_ALPHABET[k] for k in rng.integers(len(_ALPHABET), size=int(rng.integers(0, 4))))
            elif kind == 1:
                fields[j] += b"".join(_ALPHABET[k] for k in rng.integers(3, size=int(rng.integers(1, 20))))
            elif kind == 2:
                fields[j] = b""
            else:
                del fields[j]
            rows[i] = b"\t".join(fields)
        want = checked_or_error(rows)
        assert_same(parsed_or_error(rows), want)
        fast = pre.parse_rows_fast(rows)
        if fast is not None:  # what the fast path answers itself must be the reference's answer
            fast_taken += 1
            assert_same(fast, want)
        errors += isinstance(want, str)
    return fast_taken, errors


def test_fuzzed_rows_parse_as_the_reference():
    fast_taken, errors = fuzz(300, seed=10)
    assert fast_taken > 30 and errors > 30  # both sides of the fallback were exercised


@pytest.mark.soak
def test_fuzzed_rows_soak():
    fuzz(20_000 if os.environ.get("AZULITE_SOAK") == "1" else 300, seed=20261124)


def request(rows: np.ndarray) -> pb_utils.InferenceRequest:
    return pb_utils.InferenceRequest(model_name="dlrm_preprocess", requested_output_names=[],
                                     inputs=[pb_utils.Tensor("ROW", rows.reshape(-1, 1))])


def test_triton_model_parses_a_dynamic_batch_as_one_and_fails_only_the_bad_request():
    model = pre.TritonPythonModel()
    parts = [sample_rows(n, seed=n).reshape(-1) for n in (1, 3, 32)]
    responses = model.execute([request(p) for p in parts])
    for rows, response in zip(parts, responses):
        assert not response.has_error()
        got = {t.name(): t.as_numpy() for t in response.output_tensors()}
        assert_same((got[pre.DENSE_OUTPUT], got[pre.CATEGORY_OUTPUT]), pre.parse_rows_checked(rows))
    bad = parts[1].copy()
    bad[1] = b"1\t2\tnot-a-row"
    responses = model.execute([request(parts[0]), request(bad), request(parts[2])])
    assert [r.has_error() for r in responses] == [False, True, False]
    assert responses[1].error().message().startswith("row 1: 3 tab-separated fields")
    got = {t.name(): t.as_numpy() for t in responses[2].output_tensors()}
    assert_same((got[pre.DENSE_OUTPUT], got[pre.CATEGORY_OUTPUT]), pre.parse_rows_checked(parts[2]))


def test_the_served_text_is_this_module():
    assert PREPROCESS_MODEL_PY == Path(pre.__file__).read_text()
    assert "azulite" not in "".join(line for line in PREPROCESS_MODEL_PY.splitlines() if "import" in line)


@pytest.mark.skipif(not ANCHOR_PYTHON.exists(), reason="the anchors' venv (scripts/anchors.sh) is not installed")
def test_the_fast_path_runs_in_triton_python_environment(tmp_path):
    """Real Triton runs the model.py with its own numpy (1.26 in the anchors' venv): same answers there."""
    rows = sample_rows(40, seed=5).reshape(-1)
    np.save(tmp_path / "rows.npy", rows, allow_pickle=True)
    script = (f"import sys, numpy as np\nsys.path.insert(0, {str(Path(pre.__file__).parent)!r})\n"
              "import dlrm_preprocess as p\n"
              f"rows = np.load({str(tmp_path / 'rows.npy')!r}, allow_pickle=True)\n"
              "fast = p.parse_rows_fast(rows)\nassert fast is not None\n"
              f"np.save({str(tmp_path / 'dense.npy')!r}, fast[0]); np.save({str(tmp_path / 'cats.npy')!r}, fast[1])\n"
              "print(np.__version__)\n")
    p = subprocess.run([str(ANCHOR_PYTHON), "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert_same((np.load(tmp_path / "dense.npy"), np.load(tmp_path / "cats.npy")), pre.parse_rows_checked(rows))


def toy_graph(path: Path) -> None:
    """An ONNX graph with the DLRM model's signature: SCORE = sum(DENSE_RAW) + 3 * sum(CATEGORY_IDS % 1000),
    per row (FP32 [B, 1]): every input field moves the score, so a row scored against another's parse shows."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Constant", [], ["m"], value=helper.make_tensor("m", TensorProto.INT64, [], [1000])),
        helper.make_node("Mod", ["CATEGORY_IDS", "m"], ["cm"]),
        helper.make_node("Cast", ["DENSE_RAW"], ["d"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["cm"], ["c"], to=TensorProto.FLOAT),
        helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("axes", TensorProto.INT64, [1], [1])),
        helper.make_node("ReduceSum", ["d", "axes"], ["ds"], keepdims=1),
        helper.make_node("ReduceSum", ["c", "axes"], ["cs"], keepdims=1),
        helper.make_node("Constant", [], ["three"], value=helper.make_tensor("three", TensorProto.FLOAT, [], [3.0])),
        helper.make_node("Mul", ["cs", "three"], ["cs3"]),
        helper.make_node("Add", ["ds", "cs3"], ["SCORE"]),
    ]
    graph = helper.make_graph(
        nodes, "toy_dlrm",
        [helper.make_tensor_value_info("DENSE_RAW", TensorProto.INT64, ["batch", 13]),
         helper.make_tensor_value_info("CATEGORY_IDS", TensorProto.INT64, ["batch", 26])],
        [helper.make_tensor_value_info("SCORE", TensorProto.FLOAT, ["batch", 1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def toy_score(rows: np.ndarray) -> np.ndarray:
    dense, cats = pre.parse_rows_checked(rows)
    return (dense.sum(axis=1, keepdims=True) + 3 * (cats % 1000).sum(axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture
def scoring_model(tmp_path):
    """The one-step model.py as written by the export, in a version folder beside a model.onnx."""
    (tmp_path / "dlrm" / "1").mkdir(parents=True)
    toy_graph(tmp_path / "dlrm" / "1" / "model.onnx")
    namespace: dict = {"__name__": "scoring_model_under_test"}
    exec(compile(SCORING_MODEL_PY, "model.py", "exec"), namespace)  # noqa: S102 - the served text
    model = namespace["TritonPythonModel"]()
    model.initialize({"model_config": "{}", "model_repository": str(tmp_path / "dlrm"), "model_version": "1"})
    return model


def test_scoring_model_scores_a_dynamic_batch_in_one_run_and_fails_only_the_bad_request(scoring_model):
    assert type(scoring_model).__name__ == "ScoringModel"
    runs = []
    run = scoring_model.session.run
    scoring_model.session = type("Counted", (), {"run": lambda self, *a: runs.append(a) or run(*a)})()
    parts = [sample_rows(n, seed=10 + n).reshape(-1) for n in (1, 3, 32)]
    responses = scoring_model.execute([request(p) for p in parts])
    assert len(runs) == 1 and len(runs[0][1]["DENSE_RAW"]) == 36  # one session run for the whole batch
    for rows, response in zip(parts, responses):
        assert not response.has_error()
        np.testing.assert_array_equal(response.output_tensors()[0].as_numpy(), toy_score(rows))
    bad = parts[1].copy()
    bad[1] = b"1\t2\tnot-a-row"
    runs.clear()
    responses = scoring_model.execute([request(parts[0]), request(bad), request(parts[2])])
    assert [r.has_error() for r in responses] == [False, True, False]
    assert responses[1].error().message().startswith("row 1: 3 tab-separated fields")
    assert responses[1].error().code() == pb_utils.TritonError.INVALID_ARG  # the client's mistake
    assert len(runs) == 1 and len(runs[0][1]["DENSE_RAW"]) == 33  # the good requests still in one run
    np.testing.assert_array_equal(responses[0].output_tensors()[0].as_numpy(), toy_score(parts[0]))
    np.testing.assert_array_equal(responses[2].output_tensors()[0].as_numpy(), toy_score(parts[2]))
    only_bad = scoring_model.execute([request(bad)])
    assert only_bad[0].has_error()
    np.testing.assert_array_equal(scoring_model.run_batch({"ROW": parts[2]})["SCORE"], toy_score(parts[2]))


def test_the_one_step_text_is_this_module_serving_its_scoring_model():
    assert SCORING_MODEL_PY.startswith(PREPROCESS_MODEL_PY)
    assert SCORING_MODEL_PY[len(PREPROCESS_MODEL_PY):].strip().startswith("TritonPythonModel = ScoringModel")
    # azulite runs a Python model inline only when its text cannot make a BLS call
    assert "InferenceRequest" not in SCORING_MODEL_PY
