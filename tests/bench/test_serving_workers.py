"""bench/serving_workers.py's summary of azulite's default placement (gil_py as threads with --workers 1)
against Triton's gil_py: each round's pair, its median, and goals that a single point below Triton fails."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import serving_workers  # noqa: E402


def point(infer_per_s: float, cpu_s_per_1k: float, p99_ms: float = 2.0) -> dict:
    return {"infer_per_s": infer_per_s, "cpu_s_per_1k": cpu_s_per_1k, "p99_ms": p99_ms}


def test_the_twin_is_read_against_tritons_own_model_round_by_round() -> None:
    rounds = {
        ("triton", "gil_py_http_c1"): [point(500, 1.6), point(520, 1.6)],
        ("azulite_w1", "gil_py_http_c1"): [point(510, 1.7), point(515, 1.7)],  # processes: not the default
        ("azulite_w1", "gil_py_threads_http_c1"): [point(600, 1.2), point(520, 1.28)],
        ("triton", "bench_matmul_http_c1"): [point(900, 0.5)],
        ("azulite_w1", "bench_matmul_proc_http_c1"): [point(1, 9.0)],  # a processes twin: never the default
    }
    default, goals = serving_workers.default_placement_over_triton(rounds)
    assert list(default) == ["gil_py_threads_http_c1"]
    assert default["gil_py_threads_http_c1"]["rounds"]["throughput"] == [1.2, 1.0]
    assert default["gil_py_threads_http_c1"]["throughput"] == 1.1
    assert default["gil_py_threads_http_c1"]["cpu_per_inference"] == 0.775
    assert goals == {"throughput_ge_triton": True, "cpu_le_triton": True}


def test_one_point_below_triton_fails_its_goal_and_an_unmeasured_one_is_left_out() -> None:
    rounds = {
        ("triton", "gil_py_grpc_c8"): [point(1000, 1.0)],
        ("azulite_w1", "gil_py_threads_grpc_c8"): [point(990, 0.9)],
        ("triton", "gil_py_grpc_c32"): [point(1000, 1.0)],
        ("azulite_w1", "gil_py_threads_grpc_c32"): [{"error": "refused"}],
    }
    default, goals = serving_workers.default_placement_over_triton(rounds)
    assert list(default) == ["gil_py_threads_grpc_c8"]
    assert goals == {"throughput_ge_triton": False, "cpu_le_triton": True}


def test_no_twin_measured_gives_no_goals() -> None:
    rounds = {("triton", "gil_py_http_c1"): [point(500, 1.6)], ("azulite_w1", "gil_py_http_c1"): [point(510, 1.7)]}
    assert serving_workers.default_placement_over_triton(rounds) == ({}, None)
