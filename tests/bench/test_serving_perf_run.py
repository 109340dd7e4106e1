"""bench/serving.py's perf_analyzer runner: a run that never ends is killed and measured again on a shorter
window, a spread too wide is measured again accepting any spread, and what could not be measured says why.

perf_analyzer 2.51 itself cannot be made to stall on demand (it takes an idle machine and a fast server), so a
stand-in script plays it here: it answers the runner's command line the way perf_analyzer does (a CSV at -f,
exit 0) or not (no CSV, exit 1), or never exits, depending on the window (-p) and spread it is given."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import serving  # noqa: E402

FAKE = """#!{python}
import sys, time
args = sys.argv[1:]
window, spread, out = args[args.index("-p") + 1], args[args.index("--stability-percentage") + 1], args[args.index("-f") + 1]
if (window, spread) in {stall}:  # killed by the runner: what it did before that is not asserted on
    time.sleep(3600)
with open({log!r}, "a") as log:
    log.write(window + " " + spread + "\\n")
if (window, spread) in {fail}:
    print("Failed to obtain stable measurement")
    sys.exit(1)
with open(out, "w") as f:
    f.write("Concurrency,Inferences/Second,p50 latency,p99 latency\\n32,12345.6,2000,4500\\n")
"""


def _fake(tmp_path: Path, stall: set = frozenset(), fail: set = frozenset()) -> tuple[Path, Path]:
    log = tmp_path / "calls.txt"
    pa = tmp_path / "perf_analyzer"
    pa.write_text(FAKE.format(python=sys.executable, log=str(log), stall=set(stall) or "set()",
                              fail=set(fail) or "set()"))
    pa.chmod(pa.stat().st_mode | stat.S_IXUSR)
    return pa, log


def _run(pa: Path, tmp_path: Path) -> dict:
    # a bound of a few seconds for the 1500 ms window, generous for the rest: the stall is the only kill
    return serving.perf_run(pa, "m", "http", 1, 32, tmp_path / "in.json", 1500, tmp_path,
                            deadline_s=lambda w: 2.0 if w == 1500 else 120.0)


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines()


def test_a_run_that_measures_is_read_once(tmp_path: Path) -> None:
    pa, log = _fake(tmp_path)
    r = _run(pa, tmp_path)
    assert r == {"infer_per_s": 12345.6, "p50_ms": 2.0, "p99_ms": 4.5, "stable": True}
    assert _calls(log) == ["1500 50"]


def test_a_stalled_run_is_killed_and_measured_on_a_third_of_the_window(tmp_path: Path) -> None:
    pa, log = _fake(tmp_path, stall={("1500", "50")})
    r = _run(pa, tmp_path)
    assert r["infer_per_s"] == 12345.6 and r["stable"] is True
    assert r["window_ms"] == 500 and r["stalled_runs"] == 1
    assert _calls(log) == ["500 50"]


def test_a_wide_spread_is_measured_again_accepting_any_and_said(tmp_path: Path) -> None:
    pa, log = _fake(tmp_path, fail={("1500", "50")})
    r = _run(pa, tmp_path)
    assert r["stable"] is False and "window_ms" not in r
    assert _calls(log) == ["1500 50", "1500 1000"]


def test_a_failing_point_is_an_error_though_an_old_figure_lies_there(tmp_path: Path) -> None:
    pa, log = _fake(tmp_path, fail={("1500", "50"), ("1500", "1000")})
    (tmp_path / "pa-m-http-32.csv").write_text("Concurrency,Inferences/Second,p50 latency,p99 latency\n32,1,1,1\n")
    r = _run(pa, tmp_path)
    assert "error" in r and "stable measurement" in r["error"]


def test_a_point_that_fails_after_a_stall_says_why(tmp_path: Path) -> None:
    pa, log = _fake(tmp_path, stall={("1500", "50")}, fail={("500", "50"), ("500", "1000")})
    r = _run(pa, tmp_path)
    assert "stable measurement" in r["error"] and r["stalled_runs"] == 1
    assert _calls(log) == ["500 50", "500 1000"]


def test_a_point_that_stalls_on_every_window_says_so(tmp_path: Path) -> None:
    pa, log = _fake(tmp_path, stall={("1500", "50"), ("500", "50"), ("500", "1000")})
    r = serving.perf_run(pa, "m", "http", 1, 32, tmp_path / "in.json", 1500, tmp_path, deadline_s=lambda w: 2.0)
    assert "did not finish within 2 s on a 500 ms window" in r["error"] and r["stalled_runs"] == 1
    assert not log.exists()
