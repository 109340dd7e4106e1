"""bench/serve_models.py's ceiling arithmetic (the measuring needs perf_analyzer and runs in the bench)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import serve_models as sm  # noqa: E402


def test_the_ceiling_is_the_cores_over_client_plus_model_cpu_per_row() -> None:
    # bare loop 5 us/row on one core: 200k rows/s. Two cores shared with a client at 5 us/row: 2e6 / 10 us
    # = 200k rows/s, the same as the bare loop
    assert sm.ceiling_vs_bare(5.0, 5.0, 2) == pytest.approx(1.0)
    # a client costing nothing: the server could use both cores, twice the bare loop
    assert sm.ceiling_vs_bare(5.0, 0.0, 2) == pytest.approx(2.0)
    # 1-row requests: the client's CPU per row dwarfs the model's
    assert sm.ceiling_vs_bare(4.0, 36.0, 2) == pytest.approx(0.2)
    assert sm.ceiling_vs_bare(4.0, 12.0, 1) == pytest.approx(0.25)


@pytest.mark.parametrize("bare, client, cores", [(0.0, 1.0, 2), (-1.0, 1.0, 2), (1.0, -0.5, 2), (1.0, 1.0, 0)])
def test_the_ceiling_refuses_figures_that_cannot_be(bare: float, client: float, cores: int) -> None:
    with pytest.raises(ValueError, match="CPU per row"):
        sm.ceiling_vs_bare(bare, client, cores)


def test_the_bare_loop_is_warmed_up_before_its_first_measured_point() -> None:
    runs: list[tuple[int, float]] = []

    def bare(batch: int, seconds: float) -> tuple[float, float]:
        runs.append((batch, seconds))
        return float(batch), float(len(runs))  # which run answered a point: its position

    points = sm.bare_points(bare, [32], 32, 64, 3.0)
    # --concurrency 32 alone: the only measured point is not the process's first loop
    assert runs == [(64, sm.BARE_WARMUP_S), (64, 3.0)]
    assert points == [(32, 64, (64.0, 2.0))]
    runs.clear()
    points = sm.bare_points(bare, [1, 8, 32], 1, 64, 2.0)
    assert runs == [(1, sm.BARE_WARMUP_S), (1, 2.0), (8, 2.0), (32, 2.0)]
    assert [(c, b) for c, b, _ in points] == [(1, 1), (8, 8), (32, 32)]
    assert sm.bare_points(bare, [], 1, 64, 2.0) == []
