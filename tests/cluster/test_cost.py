"""The cost model reproduces the seeds' figures where they follow from the seeds' own prices, and shows
the computation where they do not (the T4 month)."""

from __future__ import annotations

import math

import pytest

from azulite.catalog import get_sku
from azulite.cluster.cost import CostError, serving_cost, training_cost, young_daly_interval
from azulite.errors import PriceUnknown


def test_arr_coc_training_306_on_demand_92_spot():
    nc24 = get_sku("NC24rs_v3")
    assert training_cost(nc24, 2, 50).total_usd == pytest.approx(306.0)
    spot = training_cost(nc24, 2, 50, pricing="spot", eviction_rate=0)
    assert spot.total_usd == pytest.approx(92.0) and any("assume" in a for a in spot.assumptions)


def test_spot_prices_the_expected_evictions():
    est = training_cost(get_sku("NC24rs_v3"), 2, 50, pricing="spot", eviction_rate=0.01, save_seconds=60, restart_seconds=300)
    assert est.compute_usd == pytest.approx(92.0)
    lam = 0.01 * 2 / 3600
    tau = math.sqrt(2 * 60 / lam)
    assert est.checkpoint_interval_s == pytest.approx(tau)
    t = 50 * (1 + 60 / tau) / (1 - lam * (tau / 2 + 300))
    assert est.expected_hours == pytest.approx(t)
    assert est.total_usd == pytest.approx(t * 2 * 0.92) and est.total_usd > 92
    assert est.expected_evictions == pytest.approx(lam * t * 3600)


def test_torchrec_nd96asr_v4_27_54_108_per_hour():
    nd = get_sku("ND96asr_v4")
    assert [training_cost(nd, n, 1).total_usd for n in (1, 2, 4)] == pytest.approx([27.0, 54.0, 108.0])
    assert training_cost(nd, 4, 1, pricing="spot", eviction_rate=0).total_usd == pytest.approx(38.0)


def test_t4_month_shows_its_hours_per_month_assumption():
    t4 = get_sku("NC4as_T4_v3")
    assert serving_cost(t4, hours_per_month=720).monthly_usd == pytest.approx(378.72)
    m730 = serving_cost(t4)
    assert m730.monthly_usd == pytest.approx(383.98) and "730 hours per month" in m730.assumptions[0]
    # the seed's $379.68 follows from neither convention: it would need 721.8 h
    assert 379.68 / 0.526 == pytest.approx(721.825, abs=1e-3)
    assert serving_cost(t4, mode="scale-to-zero", utilization=0.5, hours_per_month=720).monthly_usd == pytest.approx(189.36)


def test_serving_from_a_request_rate_curve():
    t4 = get_sku("NC4as_T4_v3")
    curve = [0.0] * 8 + [50.0] * 8 + [120.0] * 8      # a day: quiet night, busy day
    zero = serving_cost(t4, mode="scale-to-zero", curve=curve, capacity_rps=50, hours_per_month=720)
    assert zero.hourly_replicas == [0] * 8 + [1] * 8 + [3] * 8
    assert zero.monthly_usd == pytest.approx((0 + 8 + 24) / 24 * 720 * 0.526)
    one = serving_cost(t4, mode="autoscale", curve=curve, capacity_rps=50, hours_per_month=720)
    assert one.monthly_usd == pytest.approx((8 + 8 + 24) / 24 * 720 * 0.526)


def test_young_daly():
    assert young_daly_interval(60, 3600 * 50) == pytest.approx(math.sqrt(2 * 60 * 180000))
    with pytest.raises(CostError):
        young_daly_interval(0, 100)


@pytest.mark.parametrize("kw, words", [
    ({"hours": 0}, "hours must be > 0"), ({"hours": -3}, "hours must be > 0"), ({"nodes": 0}, "nodes must be >= 1"),
    ({"pricing": "cheap"}, "unknown pricing"),
    ({"pricing": "spot", "eviction_rate": 5.0}, "never to finish"),
])
def test_bad_cost_inputs(kw, words):
    args = {"nodes": 2, "hours": 50} | kw
    with pytest.raises(CostError, match=words):
        training_cost(get_sku("NC24rs_v3"), args.pop("nodes"), args.pop("hours"), **args)


def test_unknown_price_is_an_error_not_a_guess():
    with pytest.raises(PriceUnknown) as e:
        training_cost(get_sku("ND96isr_H100_v5"), 1, 1)
    assert "no on_demand price" in str(e.value) and "--catalog" in str(e.value)
    assert e.value.fix.startswith("add a [[price]]")  # with no known price it read "or add ..."
    with pytest.raises(PriceUnknown, match="known for this SKU: on_demand, spot, savings_1y, savings_3y"):
        training_cost(get_sku("NC24rs_v3"), 1, 1, pricing="reserved_1y")
