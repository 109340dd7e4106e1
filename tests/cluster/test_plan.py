"""The planner's pick is never beaten by an exhaustive search that scores every catalog candidate through
the simulator; its checkpoint interval is Young/Daly's with the measured save duration."""

from __future__ import annotations

import math

import pytest

from azulite.catalog import get_sku
from azulite.cluster.cost import CostError
from azulite.cluster.plan import Job, plan

CASES = [
    {},
    {"deadline_h": 20},
    {"deadline_h": 10},
    {"budget_usd": 150},
    {"deadline_h": 30, "budget_usd": 120},
    {"deadline_h": 24, "speedup": {"A100": 2.5}},
    {"deadline_h": 12, "eviction_rate": 0.2},
    # spot's lower bound is simulated first, but evictions make it slower than on-demand: the bound must go on
    {"budget_usd": 600, "eviction_rate": 0.2},
]


@pytest.mark.parametrize("kw", CASES, ids=[str(c) for c in CASES])
def test_pick_equals_exhaustive_simulated_search(kw):
    job = Job(hours=50, ref_sku=get_sku("NC24rs_v3"), ref_nodes=2, save_seconds=45, save_source="test")
    common = dict(runs=6) | kw
    fast = plan(job, **common)
    full = plan(job, exhaustive=True, **common)
    assert fast.pick is not None and full.pick is not None
    assert (fast.pick.sku, fast.pick.nodes, fast.pick.spot) == (full.pick.sku, full.pick.nodes, full.pick.spot)
    assert fast.pick.cost_mean == pytest.approx(full.pick.cost_mean)
    assert fast.simulated <= full.simulated
    if not kw:
        assert fast.simulated < full.simulated  # the bound prunes: not itself the exhaustive search
    # never beaten: no feasible candidate of the exhaustive search is better on the objective
    by_time = "fastest" in full.objective
    for c in full.candidates:
        if c.simulated and c.feasible:
            if by_time:
                assert full.pick.hours_mean <= c.hours_mean
            else:
                assert full.pick.cost_mean <= c.cost_mean
    if "deadline_h" in kw:
        assert fast.pick.hours_p90 <= kw["deadline_h"]
    if "budget_usd" in kw:
        assert fast.pick.cost_mean <= kw["budget_usd"]


def test_spot_pick_checkpoints_at_young_daly_interval():
    job = Job(hours=50, ref_sku=get_sku("NC24rs_v3"), ref_nodes=2, save_seconds=45)
    p = plan(job, deadline_h=20, eviction_rate=0.05, runs=4)
    assert p.pick.spot
    mtbf = 3600 / (0.05 * p.pick.nodes)
    assert p.pick.checkpoint_interval_s == pytest.approx(math.sqrt(2 * 45 * mtbf))
    assert p.pick.cost_p10 <= p.pick.cost_mean <= p.pick.cost_p90


def test_without_a_seed_price_or_speed_a_sku_is_listed_not_weighed():
    job = Job(hours=50, ref_sku=get_sku("NC24rs_v3"), ref_nodes=2)
    p = plan(job, runs=2, speedup={"A100": 2.5, "H100": 5})
    notes = {c.label: c.note for c in p.candidates}
    assert "price unknown" in notes["8 x ND96isr_H100_v5 on-demand"]
    assert "single node only" in notes["2 x NC24ads_A100_v4 on-demand"]
    assert not any("NC4as_T4" in c.sku for c in p.candidates)  # T4: no speed given, not weighed


def test_evictions_faster_than_progress_are_not_simulated():
    job = Job(hours=50, ref_sku=get_sku("NC24rs_v3"), ref_nodes=2)
    p = plan(job, eviction_rate=3.0, runs=2)
    notes = {c.label: c.note for c in p.candidates}
    assert "outpace progress" in notes["16 x NC24rs_v3 spot"]
    assert p.pick is not None and "outpace" not in p.pick.note


def test_impossible_deadline_has_no_pick_and_bad_inputs_are_errors():
    job = Job(hours=50, ref_sku=get_sku("NC24rs_v3"), ref_nodes=2)
    assert plan(job, deadline_h=1, runs=2).pick is None
    assert plan(job, deadline_h=100, runs=2).no_pick == ""
    with pytest.raises(CostError, match="deadline must be > 0"):
        plan(job, deadline_h=0)
    with pytest.raises(CostError, match="hours must be > 0"):
        plan(Job(hours=0, ref_sku=get_sku("NC24rs_v3")))


def test_no_pick_names_the_fastest_or_cheapest_candidate_and_its_figure():
    # "no candidate could be weighed" when each was weighed and none met the deadline
    job = Job(hours=50, ref_sku=get_sku("NC24rs_v3"), ref_nodes=2)
    p = plan(job, deadline_h=5, runs=2)
    assert p.pick is None and p.simulated == 0
    assert p.no_pick == ("none finishes within the deadline of 5 h: the fastest, 16 x NC24rs_v3 on-demand, needs 8.6 h "
                         "without evictions")
    assert plan(job, budget_usd=10, runs=2).no_pick == ("none fits the budget of $10.00: the cheapest, 1 x NC24rs_v3 spot, "
                                                        "costs $82.80 for compute alone")
    both = plan(job, deadline_h=12, budget_usd=100, runs=2)  # each is met by some candidate, not both by one
    assert both.pick is None and both.no_pick == "no candidate meets the deadline and the budget together"
    # a simulated candidate over the budget is named by its expected cost (its bound, $82.80, was within it)
    tight = plan(job, budget_usd=83, runs=2)
    assert tight.pick is None and tight.simulated == 1
    assert tight.no_pick.startswith("none fits the budget of $83.00: the cheapest, 1 x NC24rs_v3 spot, costs an expected $8")
