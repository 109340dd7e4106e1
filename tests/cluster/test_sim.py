"""The simulator against things we know: an M/M/c queue's waiting time (Erlang C), gang placement,
priorities and preemption, the autoscaler's delays, spot evictions with checkpoints, billing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from azulite.cluster.pools import Pool
from azulite.cluster.sim import Settings, simulate
from azulite.cluster.trace import Trace
from azulite.errors import SimulationError

def pool(node_gpus=8, nodes=1, *, min_nodes=None, max_nodes=None, price=1.0, spot=False, rate=0.0, name="p"):
    return Pool(name=name, sku="X", node_gpus=node_gpus, usd_per_hour=price, price_label="",
                min_nodes=nodes if min_nodes is None else min_nodes, max_nodes=nodes if max_nodes is None else max_nodes,
                start_nodes=nodes, spot=spot, evictions_per_hour=rate)


def trace(rows, **kw):
    ids = [r[0] for r in rows]
    return Trace.from_columns(ids, [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
                              priority=[r[4] if len(r) > 4 else 0 for r in rows],
                              checkpoint_interval=[r[5] if len(r) > 5 else math.inf for r in rows], **kw)


def erlang_c_wait(c: int, lam: float, mu: float) -> float:
    a = lam / mu
    top = a**c / math.factorial(c) * c / (c - a)
    return top / (sum(a**k / math.factorial(k) for k in range(c)) + top) / (c * mu - lam)


def _mmc(c: int, rho: float, n: int, seed: int) -> dict:
    # Poisson arrivals, exponential service, c one-GPU servers, FIFO
    lam, mu = 1.0, 1.0 / (rho * c)
    rng = np.random.default_rng(seed)
    t = Trace.from_columns([str(i) for i in range(n)], np.cumsum(rng.exponential(1 / lam, n)), np.ones(n, int),
                           rng.exponential(1 / mu, n))
    r = simulate(t, [pool(node_gpus=1, nodes=c)], Settings(autoscale=False))
    assert r.finished == n
    wait = r.start - t.submit
    return {"mean": r.queue_mean_s, "p_wait": (wait > 0).mean(), "p_tail": (wait > 2 / (c * mu - lam)).mean(),
            "util": r.gpu_utilization, "lam": lam, "mu": mu}


def _check(c: int, rho: float, runs: list[dict], tol: float) -> None:
    lam, mu = runs[0]["lam"], runs[0]["mu"]
    avg = {k: float(np.mean([r[k] for r in runs])) for k in ("mean", "p_wait", "p_tail", "util")}
    # W_q = C(c, a) / (c mu - lambda); P(W > 0) = C(c, a); P(W > t) = C(c, a) exp(-(c mu - lambda) t) (FIFO)
    prob_wait = erlang_c_wait(c, lam, mu) * (c * mu - lam)
    assert avg["mean"] == pytest.approx(erlang_c_wait(c, lam, mu), rel=tol)
    assert avg["p_wait"] == pytest.approx(prob_wait, rel=tol / 2)
    assert avg["p_tail"] == pytest.approx(prob_wait * math.exp(-2), rel=1.5 * tol)
    assert avg["util"] == pytest.approx(rho, rel=0.03)


@pytest.mark.parametrize("c, rho", [(1, 0.5), (4, 0.7), (8, 0.8)])
def test_mmc_queue_waiting_time_matches_erlang_c(c, rho):
    _check(c, rho, [_mmc(c, rho, 100_000, seed=7)], tol=0.07)


@pytest.mark.soak
@pytest.mark.parametrize("c, rho", [(1, 0.5), (4, 0.7), (8, 0.8), (32, 0.8)])
def test_mmc_soak_pooled_over_seeds(c, rho):
    # one run's mean wait strays by ~10% at large c (rare, correlated waits); five pooled runs do not
    _check(c, rho, [_mmc(c, rho, 400_000, seed=s) for s in range(5)], tol=0.04)


def test_gang_job_waits_for_whole_nodes_and_small_jobs_pass_it():
    # 2 nodes x 8 GPUs. "big" (16 GPUs) must wait for both nodes to be wholly free; "small" (4) fits beside "a".
    t = trace([("a", 0, 4, 100), ("big", 1, 16, 50), ("small", 2, 4, 10)])
    r = simulate(t, [pool(nodes=2)], Settings(autoscale=False))
    start = dict(zip(t.ids, r.start))
    assert start["a"] == 0 and start["small"] == 2 and start["big"] == 100
    assert r.end[1] == 150 and r.makespan_s == 150


def test_priority_preempts_lower_and_loses_work_since_checkpoint():
    # "low" checkpoints every 30 s of work; "high" arrives at t=100 and needs the whole node
    t = trace([("low", 0, 8, 1000, 0, 30), ("high", 100, 8, 50, 10)])
    r = simulate(t, [pool(nodes=1)], Settings(autoscale=False, restart_overhead=5))
    assert r.preemptions == 1
    assert r.start[1] == 100 and r.end[1] == 150
    # low: 90 s of its 100 kept (checkpoint at 90), 10 s x 8 GPUs lost; resumes at 150 after a 5 s restore
    assert r.lost_gpu_hours == pytest.approx(10 * 8 / 3600)
    assert r.end[0] == pytest.approx(150 + 5 + (1000 - 90))


def test_equal_priority_never_preempts():
    t = trace([("a", 0, 8, 100), ("b", 1, 8, 10)])
    r = simulate(t, [pool(nodes=1)], Settings(autoscale=False))
    assert r.preemptions == 0 and r.start[1] == 100


def test_autoscaler_scale_up_delay_and_scale_down_unneeded_time():
    s = Settings(scale_up_delay=300, scale_down_unneeded_time=600, scale_down_delay_after_add=0)
    t = trace([("a", 0, 8, 1000), ("b", 2000, 8, 1000)])
    r = simulate(t, [pool(nodes=0, min_nodes=0, max_nodes=2, price=3.6)], s)
    assert r.start[0] == 300 and r.queue_p50_s == 300
    # node up from 0 (billed from the request) to 1300 + 600 idle = 1900, then a new one 2000 -> 3300
    assert r.scale_ups == 2 and r.scale_downs == 1
    assert r.node_hours_by_pool["p"] == pytest.approx((1900 + 1300) / 3600)
    assert r.cost_usd == pytest.approx(3.6 * (1900 + 1300) / 3600)


def test_scale_ups_and_downs_both_count_nodes():
    # a 4-node gang's scale-up counted 1 and its scale-down 4 (the example printed 11 / 13)
    s = Settings(scale_up_delay=100, scale_down_unneeded_time=60, scale_down_delay_after_add=0)
    r = simulate(trace([("gang", 0, 16, 1000), ("one", 5000, 4, 10)]), [pool(node_gpus=4, nodes=0, min_nodes=0, max_nodes=4)], s)
    assert r.start[0] == 100 and r.start[1] == 5100
    assert r.scale_ups == 5 and r.scale_downs == 4  # 4 for the gang, 1 later; the last node is still up at the end
    assert r.summary()["scale_ups"] == 5


def test_scale_down_delay_after_add_holds_idle_nodes():
    t = trace([("a", 0, 8, 50), ("b", 10, 8, 50), ("c", 5000, 8, 10)])
    held = simulate(t, [pool(nodes=0, min_nodes=0, max_nodes=2)],
                    Settings(scale_up_delay=100, scale_down_unneeded_time=60, scale_down_delay_after_add=1000))
    # nodes requested at 0 and 10 idle from 150 / 160; unneeded at 210 / 220 but held until 10 + 1000
    assert held.scale_downs == 2
    assert held.node_hours_by_pool["p"] == pytest.approx((1010 + 1000 + 110) / 3600)
    free = simulate(t, [pool(nodes=0, min_nodes=0, max_nodes=2)],
                    Settings(scale_up_delay=100, scale_down_unneeded_time=60, scale_down_delay_after_add=0))
    assert free.node_hours_by_pool["p"] == pytest.approx((210 + 210 + 110) / 3600)


def test_spot_evictions_lose_only_work_since_the_checkpoint():
    rng_rate = 2.0  # evictions per node-hour: several during the job
    t = trace([("ck", 0, 8, 5 * 3600, 0, 300)])
    with_ck = simulate(t, [pool(nodes=1, spot=True, rate=rng_rate)], Settings(scale_up_delay=60, restart_overhead=30, seed=3))
    assert with_ck.evictions > 0 and with_ck.finished == 1
    # each eviction loses < one interval of work plus the restore time
    assert with_ck.lost_gpu_hours <= with_ck.evictions * 8 * (300 + 30) / 3600 + 1e-9
    t2 = trace([("no-ck", 0, 8, 5 * 3600)])
    without = simulate(t2, [pool(nodes=1, spot=True, rate=rng_rate)], Settings(scale_up_delay=60, restart_overhead=30, seed=3))
    assert without.lost_gpu_hours > with_ck.lost_gpu_hours and without.makespan_s > with_ck.makespan_s


def test_job_that_can_never_fit_is_named():
    t = trace([("ok", 0, 8, 10), ("huge", 1, 64, 10)])
    with pytest.raises(SimulationError) as e:
        simulate(t, [pool(nodes=1, max_nodes=4)], Settings())
    assert "'huge' needs 64 GPUs" in str(e.value) and "at most 32" in str(e.value)


def test_taints_and_selectors_steer_jobs():
    from azulite.cluster.pools import eligible

    spot = Pool("spot", "X", 8, 1.0, "", 0, 2, 1, spot=True, labels={"agentpool": "spot"},
                taints=("kubernetes.azure.com/scalesetpriority=spot:NoSchedule",))
    od = Pool("od", "X", 8, 3.0, "", 0, 2, 1, labels={"agentpool": "od"})
    assert eligible([spot, od], (), ()) == [1]
    assert eligible([spot, od], (), ("kubernetes.azure.com/scalesetpriority=spot:NoSchedule",)) == [0, 1]
    assert eligible([spot, od], (("agentpool", "spot"),), ("kubernetes.azure.com/scalesetpriority:NoSchedule",)) == [0]
    t = trace([("a", 0, 8, 10)])
    with pytest.raises(SimulationError, match="no GPU pool matches"):
        t.selectors = [(), (("agentpool", "gpu"),)]
        t.selector = np.array([1])
        simulate(t, [spot, od], Settings())


def test_jobs_evicted_faster_than_they_progress_stop_with_an_error():
    # 120 evictions per node-hour (one every 30 s) against a 300 s restore: no progress is ever kept
    t = trace([("doomed", 0, 8, 3600, 0, 600)])
    with pytest.raises(SimulationError, match="does not converge"):
        simulate(t, [pool(nodes=1, spot=True, rate=120.0)], Settings(scale_up_delay=10, restart_overhead=300, max_events=20_000))


def test_progress_reports_reach_the_end():
    seen = []
    t = trace([(f"j{i}", i, 1, 10) for i in range(50)])
    simulate(t, [pool(node_gpus=1, nodes=2)], Settings(autoscale=False), progress=lambda d, n, now: seen.append((d, n)))
    assert seen[0] == (0, 50) and seen[-1] == (50, 50)


def test_series_hold_the_state_after_each_instant():
    # sparse events (every one sampled): each sample is the state from its time on, so the series' step
    # integrals are the busy GPU-seconds and node-seconds the run billed, and a node removed at 1900 is gone
    # in the sample at 1900 (sampling before the instant's events showed it until the next event at 2000)
    s = Settings(scale_up_delay=300, scale_down_unneeded_time=600, scale_down_delay_after_add=0)
    t = trace([("a", 0, 8, 1000), ("b", 2000, 8, 1000)])
    r = simulate(t, [pool(nodes=0, min_nodes=0, max_nodes=2)], s)
    ts, busy, nodes = r.series["t"], r.series["busy_gpus"], r.series["nodes"]

    def at(series, x):
        return series[np.searchsorted(ts, x, side="right") - 1]

    assert at(busy, 300) == 8 and at(busy, 1300) == 0 and at(nodes, 1900) == 0 and at(nodes, 2000) == 1
    assert float(np.sum(busy[:-1] * np.diff(ts))) == pytest.approx(8 * 1000 * 2)
    assert float(np.sum(nodes[:-1] * np.diff(ts))) == pytest.approx(r.node_hours_by_pool["p"] * 3600)
