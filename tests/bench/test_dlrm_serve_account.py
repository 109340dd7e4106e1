"""bench/dlrm_serve_account.py: its account's arithmetic and the model.py variants it serves (the serving
itself needs perf_analyzer and runs in the bench)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import dlrm_serve_account as acc  # noqa: E402

from azulite.export.dlrm import SCORING_MODEL_PY, sample_rows  # noqa: E402

BARE = {"whole": 140.0, "parse": 60.0, "run": 50.0}


def test_the_parts_of_the_account_sum_to_the_gap() -> None:
    gap, parts = acc.account_of(250.0, 75.0, 90.0, 85.0, BARE)
    assert gap == pytest.approx(110.0)
    assert parts["server_own_work"] == 75.0
    assert parts["parse_slower_in_server"] == pytest.approx(30.0)
    assert parts["run_slower_in_server"] == pytest.approx(35.0)
    assert sum(parts.values()) == pytest.approx(gap)
    assert parts["rest"] == pytest.approx(-30.0)  # the bare loop's own lines (30 us) counted in its whole only


@pytest.mark.parametrize("served, none, parse, run",
                         [(0.0, 1.0, 1.0, 1.0), (1.0, -1.0, 1.0, 1.0), (1.0, 1.0, 1.0, 0.0)])
def test_the_account_refuses_figures_that_cannot_be(served: float, none: float, parse: float, run: float) -> None:
    with pytest.raises(ValueError, match="CPU figures must be positive"):
        acc.account_of(served, none, parse, run, BARE)


def _variant(name: str) -> dict:
    namespace: dict = {"__file__": "/nonexistent/model.py"}
    exec(compile(SCORING_MODEL_PY + acc.VARIANTS[name], "model.py", "exec"), namespace)  # noqa: S102
    return namespace


def test_the_variants_drop_exactly_what_they_say() -> None:
    rows = sample_rows(8, seed=3).reshape(-1)
    served = _variant("served")
    assert served["TritonPythonModel"] is served["ScoringModel"]
    dense, cats = served["parse_rows_fast"](rows)
    assert dense.any() and cats.any()  # the real parse
    # no_onnx: the real parse, no session (score needs none)
    no_onnx = _variant("no_onnx")
    assert no_onnx["parse_rows_fast"](rows)[1].tolist() == cats.tolist()
    scores = no_onnx["TritonPythonModel"]().score(dense, cats)
    assert scores.shape == (8, 1) and scores.dtype == np.float32 and not scores.any()
    # no_model: neither, shapes kept
    no_model = _variant("no_model")
    d, c = no_model["parse_rows_fast"](rows)
    assert d.shape == (8, 13) and c.shape == (8, 26) and not d.any() and not c.any()
    assert no_model["TritonPythonModel"]().score(d, c).shape == (8, 1)
    # timed: the real parse, its CPU and rows summed
    timed = _variant("timed")
    assert timed["parse_rows_fast"](rows)[1].tolist() == cats.tolist()
    assert timed["_SUMS"]["rows"] == 8 and timed["_SUMS"]["parse_ns"] > 0
    assert issubclass(timed["TritonPythonModel"], timed["ScoringModel"])
