"""bench/guard_rounds.py's bookkeeping (the measuring needs perf_analyzer and runs in the bench): which
rounds stand in the medians, and that the medians are of the per-round ratios."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import guard_rounds as gr  # noqa: E402


def side(infer_per_s: float, p99_ms: float, cpu: float, **extra) -> dict:
    return {"infer_per_s": infer_per_s, "p50_ms": p99_ms / 3, "p99_ms": p99_ms, "stable": True, "failed": 0,
            "rejected": 0, "audit_lines_lost": 0, "cpu_us_per_request": cpu, "main_thread_cpu_us_per_request": cpu - 1,
            "writer_cpu_us_per_request": 0.0, "requests_per_execution": 8.0, "load_avg_1m": 1.0, **extra}


def measured(round_no: int, off: dict, on: dict) -> dict:
    row = {"round": round_no, "order": ["off", "guarded"], "off": off, "guarded": on}
    if gr.left_out(row) is None:
        row["ratio"] = gr.round_ratio(off, on)
    return row


def test_the_ratios_are_guarded_over_off() -> None:
    ratio = gr.round_ratio(side(1000, 10, 100), side(900, 12, 110, writer_cpu_us_per_request=5.0))
    assert ratio["throughput"] == 0.9 and ratio["p99"] == 1.2 and ratio["cpu_per_request"] == 1.1
    assert ratio["main_thread_cpu_per_request"] == pytest.approx(109 / 99, abs=1e-3)
    assert ratio["cpu_per_request_with_writer"] == 1.15


@pytest.mark.parametrize("change, says", [
    ({"guarded": {"rejected": 3}}, "refused by the guard (3)"),
    ({"guarded": {"failed": 2}}, "guarded 2"),
    ({"off": {"failed": 1}}, "off 1"),
    ({"guarded": {"audit_lines_lost": 7}}, "audit lines lost (7)"),
    ({"guarded": {"error": "perf_analyzer failed"}}, "perf_analyzer failed"),
])
def test_a_round_that_is_not_the_same_work_is_left_out_and_says_why(change, says) -> None:
    off, on = side(1000, 10, 100), side(990, 10, 101)
    off.update(change.get("off", {}))
    on.update(change.get("guarded", {}))
    row = {"round": 0, "off": off, "guarded": on}
    assert says in gr.left_out(row)
    assert "not measured" in gr.left_out({"round": 0, "off": off})  # a server that never started
    assert gr.left_out({"round": 0, "off": side(1000, 10, 100), "guarded": side(990, 10, 101)}) is None


def test_the_summary_is_the_median_of_the_rounds_used_and_keeps_every_round() -> None:
    rounds = [measured(0, side(1000, 10, 100), side(900, 10, 110)),
              measured(1, side(1000, 10, 100), side(1000, 11, 104)),
              measured(2, side(1000, 10, 100), side(960, 10, 103)),
              measured(3, side(1000, 10, 100), side(500, 50, 200, rejected=1))]  # refused: left out
    summary = gr.summarize(rounds)
    assert summary["rounds"] == rounds and summary["rounds_used"] == 3 and "left_out" not in rounds[0]
    assert "ratio" not in rounds[3]
    assert summary["median_ratio"]["throughput"] == 0.96  # of 0.9, 1.0, 0.96: not the 0.5 round
    assert summary["median_ratio"]["cpu_per_request"] == 1.04
    assert summary["throughput_ratio_range"] == [0.9, 1.0]
    assert summary["median_guarded"]["infer_per_s"] == 960 and summary["median_off"]["p99_ms"] == 10
    assert summary["goal_met"] == {"throughput": True, "p99": True, "cpu_per_request": True}
    worse = gr.summarize([measured(0, side(1000, 10, 100), side(940, 11, 106))])
    assert worse["goal_met"] == {"throughput": False, "p99": False, "cpu_per_request": False}


def test_no_round_used_gives_no_medians() -> None:
    summary = gr.summarize([{"round": 0, "error": "TimeoutError: server not ready", "left_out": "x"}])
    assert summary["rounds_used"] == 0 and "median_ratio" not in summary and "goal_met" not in summary


def test_the_profile_diff_lists_what_the_guard_adds_most_time_first() -> None:
    import guard_profile as gp

    off = {"route": (1.0, 2.0), "same": (3.0, 5.0), "gone": (1.0, 0.4)}
    on = {"route": (1.0, 2.1), "same": (3.0, 5.0), "check": (1.0, 2.5), "record": (1.0, 1.5)}
    rows = gp.diff(off, on)
    assert [r[4] for r in rows] == ["check", "record", "gone"]  # "same" and "route" (0.1 µs) differ too little
    assert rows[0] == (2.5, 1.0, 0.0, 1.0, "check")
    assert rows[2][:4] == (-0.4, -1.0, 1.0, 0.0)


def test_each_mode_guards_with_its_own_parts_only(tmp_path) -> None:
    """--modes: the guarded side's flags are those of its parts (the key over HTTP only), the off side none."""
    keys = tmp_path / "keys.db"

    def flags(side: str, protocol: str, mode: str) -> set[str]:
        return {a for a in gr.server_args(side, protocol, tmp_path, keys, gr.PARTS[mode]) if a.startswith("--")}

    limit, audit, auth = {"--model-rate-limit"}, {"--audit-log", "--audit-log-max-bytes"}, {"--auth", "--key-store"}
    assert flags("guarded", "http", "all") == {"--allow-grpc"} | limit | audit | auth
    assert flags("guarded", "grpc", "all") == limit | audit
    assert flags("guarded", "http", "auth") == {"--allow-grpc"} | auth
    assert flags("guarded", "http", "limit") == {"--allow-grpc"} | limit
    assert flags("guarded", "grpc", "audit") == audit
    assert flags("off", "http", "all") == {"--allow-grpc"} and flags("off", "grpc", "audit") == set()
    assert gr.server_args("guarded", "http", tmp_path, keys) == gr.server_args("guarded", "http", tmp_path, keys,
                                                                              gr.PARTS["all"])
