"""A day's request-rate curve for ``azulite cost --serve --curve FILE``: a CSV of ``hour,rps`` rows, one
for each hour 0-23 of a day (the cost model repeats the day over the month).

A header is optional; with one, its columns are found by name, so ``rps,hour`` reads as well. The file is
read as ``utf-8-sig``: a spreadsheet's CSV starts with a byte-order mark. ``#`` lines and blank lines are
skipped. Every mistake names the file and line: an hour that is no whole number in 0-23, an hour given
twice (it would count twice in the mean), a rate that is no finite number >= 0, and hours missing (a
curve of 3 hours would be priced as if the day had 3).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from azulite.errors import TraceError

HOURS = 24
_FIX = "rows of hour,rps, one for each hour 0-23, e.g. 13,42.5 (an hour without traffic is a row of 0)"


def read_curve(path: Path) -> list[float]:
    """The request rates of ``path``, indexed by hour (24 of them)."""
    rates: dict[int, float] = {}
    lines: dict[int, int] = {}
    hour_col, rate_col = 0, 1
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            first = True
            for row in reader:
                line = reader.line_num
                while row and not row[-1].strip():  # a spreadsheet's trailing empty cells
                    row = row[:-1]
                if not row or row[0].strip().startswith("#"):
                    continue
                if first and _number(row[-1]) is None:  # a header
                    first = False
                    names = [c.strip().lower() for c in row]
                    if len(names) == 2 and "hour" in names:
                        hour_col = names.index("hour")
                        rate_col = 1 - hour_col
                    continue
                first = False
                where = f"{path}:{line}"
                if len(row) != 2:
                    raise TraceError(f"a row is hour,rps: got {len(row)} column{'' if len(row) == 1 else 's'} ({','.join(row)!r})",
                                     where=where, fix=_FIX)
                rate = _number(row[rate_col])
                if rate is None or not 0 <= rate < math.inf:
                    raise TraceError(f"request rate must be a finite number >= 0, got {row[rate_col]!r}", where=where, fix=_FIX)
                hour = _number(row[hour_col])
                if hour is None or not math.isfinite(hour) or hour != int(hour) or not 0 <= hour < HOURS:
                    raise TraceError(f"hour must be a whole number from 0 to 23, got {row[hour_col]!r}", where=where, fix=_FIX)
                h = int(hour)
                if h in rates:  # counted twice in the day's mean
                    raise TraceError(f"hour {h} is given twice: also at line {lines[h]}", where=where,
                                     fix="give each hour 0-23 one row: keep one of the two")
                rates[h], lines[h] = rate, line
    except FileNotFoundError:
        raise TraceError("request-rate curve not found", where=str(path), fix="pass a CSV of hour,rps rows to --curve") from None
    except IsADirectoryError:
        raise TraceError("--curve is a directory, not a file", where=str(path), fix="pass a CSV of hour,rps rows to --curve") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise TraceError(f"cannot read the request-rate curve ({type(exc).__name__})", where=str(path),
                         fix="pass a readable CSV of hour,rps rows to --curve") from None
    missing = [h for h in range(HOURS) if h not in rates]
    if missing:
        what = "no hour,rps rows" if not rates else f"no rate for hour{'' if len(missing) == 1 else 's'} {_spans(missing)}"
        raise TraceError(f"the curve is a day of 24 hours and has {what}", where=str(path),
                         fix=f"add a row for {'each hour 0-23' if not rates else 'hour' + ('' if len(missing) == 1 else 's') + ' ' + _spans(missing)}"
                             " (0 for an hour without traffic)")
    return [rates[h] for h in range(HOURS)]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _spans(hours: list[int]) -> str:
    """``2, 5-23`` of [2, 5, 6, ..., 23]."""
    out: list[str] = []
    start = prev = hours[0]
    for h in hours[1:] + [None]:  # type: ignore[list-item]
        if h is not None and h == prev + 1:
            prev = h
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if h is not None:
            start = prev = h
    return ", ".join(out)
