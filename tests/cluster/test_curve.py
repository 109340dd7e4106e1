"""A serving request-rate curve: one hour,rps row for each hour of a day, every mistake named by file and line."""

from __future__ import annotations

import pytest

from azulite.cluster.curve import read_curve
from azulite.errors import TraceError

DAY = "hour,rps\n" + "".join(f"{h},10\n" for h in range(24))


@pytest.mark.parametrize("curve, words", [
    # each was priced as "mean over the N-hour curve x 730 h", or counted an hour twice
    ("0,0\n1,0\n2,100\n", "day.csv: the curve is a day of 24 hours and has no rate for hours 3-23 fix: add a row for hours 3-23"),
    (DAY + "5,1000\n", "day.csv:26: hour 5 is given twice: also at line 7 fix: give each hour 0-23 one row"),
    ("hour,rps\n25,1\n", "day.csv:2: hour must be a whole number from 0 to 23, got '25'"),
    ("0.5,1\n", "day.csv:1: hour must be a whole number from 0 to 23, got '0.5'"),
    ("-1,1\n", "day.csv:1: hour must be a whole number from 0 to 23, got '-1'"),
    ("0,1,2\n", "day.csv:1: a row is hour,rps: got 3 columns"),
    ("hour,rps\n# nothing yet\n", "day.csv: the curve is a day of 24 hours and has no hour,rps rows"),
    ("".join(f"{h},1\n" for h in range(24) if h != 7), "has no rate for hour 7 fix: add a row for hour 7 (0 for an hour"),
])
def test_a_curve_is_one_row_for_each_hour_of_a_day(tmp_path, curve, words):
    (tmp_path / "day.csv").write_text(curve)
    with pytest.raises(TraceError) as e:
        read_curve(tmp_path / "day.csv")
    assert words in " ".join(str(e.value).split())


def test_a_curve_is_read_by_hour_in_any_order_with_comments_and_trailing_cells(tmp_path):
    f = tmp_path / "day.csv"
    f.write_text("# a day\n" + "".join(f"{h},{2 * h},\n" for h in reversed(range(24))))  # a spreadsheet's trailing comma
    assert read_curve(f) == [2.0 * h for h in range(24)]
