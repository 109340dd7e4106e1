"""Simulator speed: a synthetic 100,000-job trace on 2,000 GPUs (goal <= 30 s wall), the same shape at
1,000,000 jobs (how wall time grows with the trace), and SimPy (the field's process-based discrete-event
library) as the anchor on a FIFO queue both can model: 1-GPU jobs on 2,000 one-GPU servers, whose mean
waits must agree.

The main trace: Poisson arrivals at ~80% offered load, GPU requests 1-32 (gangs up to 4 nodes), log-normal
durations (mean ~1 h), three priorities, checkpoints every 30 min; an on-demand and a spot pool of
ND96asr_v4-shaped nodes (8 GPUs, 125 nodes max each), the autoscaler on (5 min up, 10 min unneeded),
spot evictions at 0.02 per node-hour.

    .venv/bin/python bench/simulate.py            # 100k + 1M + SimPy anchor, ~1-2 min
    .venv/bin/python bench/simulate.py --quick    # 100k + anchor only

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from azulite.cluster.pools import Pool
from azulite.cluster.sim import Settings, simulate
from azulite.cluster.trace import Trace

SPOT = "kubernetes.azure.com/scalesetpriority=spot:NoSchedule"


def synthetic(n: int, seed: int = 0, gpus_total: int = 2000, load: float = 0.8) -> Trace:
    rng = np.random.default_rng(seed)
    sizes = np.array([1, 2, 4, 8, 16, 32])
    p = np.array([0.45, 0.2, 0.15, 0.12, 0.06, 0.02])
    gpus = rng.choice(sizes, n, p=p)
    dur = rng.lognormal(mean=np.log(3600) - 0.5, sigma=1.0, size=n).clip(30, 7 * 86400)
    rate = load * gpus_total / float((sizes * p).sum() * 3600)  # jobs per second for `load`
    submit = np.cumsum(rng.exponential(1 / rate, n))
    t = Trace.from_columns([f"j{i}" for i in range(n)], submit, gpus, dur,
                           priority=rng.choice([0, 5, 10], n, p=[0.7, 0.25, 0.05]), checkpoint_interval=np.full(n, 1800.0))
    # half the jobs tolerate spot nodes
    t.tolerations = [(), (SPOT,)]
    t.toleration = (rng.random(n) < 0.5).astype(np.int64)
    return t


def pools() -> list[Pool]:
    return [
        Pool("ondemand", "Standard_ND96asr_v4", 8, 27.0, "", 10, 125, 10),
        Pool("spot", "Standard_ND96asr_v4", 8, 9.5, "", 0, 125, 0, spot=True, evictions_per_hour=0.02, taints=(SPOT,)),
    ]


def run_azulite(n: int) -> dict:
    t = synthetic(n)
    r = simulate(t, pools(), Settings(scale_up_delay=300, scale_down_unneeded_time=600, scale_down_delay_after_add=600,
                                       restart_overhead=120, checkpoint_cost=30))
    return {"jobs": n, "wall_s": r.wall_s, "events": r.events, "events_per_s": r.events / r.wall_s,
            "finished": r.finished, "gpu_utilization": r.gpu_utilization, "queue_p50_s": r.queue_p50_s,
            "queue_p99_s": r.queue_p99_s, "evictions": r.evictions, "preemptions": r.preemptions,
            "makespan_h": r.makespan_s / 3600, "cost_usd": r.cost_usd}


def fifo_trace(n: int, c: int, rho: float = 0.995, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    service = rng.exponential(3600.0, n)
    arrivals = np.cumsum(rng.exponential(3600.0 / (rho * c), n))
    return arrivals, service


def anchor_simpy(arrivals: np.ndarray, service: np.ndarray, c: int) -> dict:
    import simpy

    env = simpy.Environment()
    servers = simpy.Resource(env, capacity=c)
    waits = np.empty(len(arrivals))

    def source():
        for i in range(len(arrivals)):
            yield env.timeout(arrivals[i] - env.now)
            env.process(job_now(i))

    def job_now(i: int):
        t0 = env.now
        with servers.request() as req:
            yield req
            waits[i] = env.now - t0
            yield env.timeout(service[i])

    env.process(source())
    w0 = time.perf_counter()
    env.run()
    return {"wall_s": time.perf_counter() - w0, "mean_wait_s": float(waits.mean())}


def azulite_fifo(arrivals: np.ndarray, service: np.ndarray, c: int) -> dict:
    n = len(arrivals)
    t = Trace.from_columns([str(i) for i in range(n)], arrivals, np.ones(n, np.int64), service)
    r = simulate(t, [Pool("p", "X", 1, 1.0, "", c, c, c)], Settings(autoscale=False))
    return {"wall_s": r.wall_s, "mean_wait_s": r.queue_mean_s, "events": r.events}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the 1,000,000-job run")
    ap.add_argument("--jobs", type=int, default=100_000)
    args = ap.parse_args()
    out: dict = {"load_avg_at_start": os.getloadavg()[0]}
    main_run = run_azulite(args.jobs)
    print(f"azulite {args.jobs:,} jobs / 2,000 GPUs: {main_run['wall_s']:.1f} s, {main_run['events_per_s']:,.0f} events/s, "
          f"util {main_run['gpu_utilization']:.1%}, p99 wait {main_run['queue_p99_s'] / 3600:.1f} h", flush=True)
    out["azulite_100k"] = main_run
    out["goal_100k_wall_s"] = 30.0
    out["meets_goal"] = main_run["wall_s"] <= 30.0
    if not args.quick:
        big = run_azulite(1_000_000)
        print(f"azulite 1,000,000 jobs: {big['wall_s']:.1f} s, {big['events_per_s']:,.0f} events/s", flush=True)
        out["azulite_1m"] = big
        out["wall_ratio_1m_vs_100k"] = big["wall_s"] / main_run["wall_s"]
    arr, svc = fifo_trace(args.jobs, 2000)
    a = azulite_fifo(arr, svc, 2000)
    s = anchor_simpy(arr, svc, 2000)
    print(f"FIFO {args.jobs:,} x 1 GPU on 2,000 servers: azulite {a['wall_s']:.1f} s (mean wait {a['mean_wait_s']:.1f} s), "
          f"SimPy {s['wall_s']:.1f} s (mean wait {s['mean_wait_s']:.1f} s)", flush=True)
    out["fifo_azulite"] = a
    out["fifo_simpy"] = s
    out["fifo_speedup_vs_simpy"] = s["wall_s"] / a["wall_s"]
    out["fifo_mean_wait_rel_diff"] = abs(a["mean_wait_s"] - s["mean_wait_s"]) / max(s["mean_wait_s"], 1e-9)
    out["load_avg_at_end"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
