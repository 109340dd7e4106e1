"""What a simulation takes and gives: its settings, its result, and the check that every job of a trace
fits some pool (done before the first event, so a hopeless job is named instead of waiting forever)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from azulite.cluster.pools import Pool, eligible
from azulite.cluster.trace import Trace
from azulite.errors import SimulationError


@dataclass
class Settings:
    """How the autoscaler and restarts behave (seconds). ``checkpoint_cost`` is the save duration delta."""

    autoscale: bool = True
    scale_up_delay: float = 300.0
    scale_down_unneeded_time: float = 600.0
    scale_down_delay_after_add: float = 600.0
    restart_overhead: float = 120.0
    checkpoint_cost: float = 0.0
    least_cost: bool = True
    seed: int = 0
    #: at most this many samples of the time series (utilization, queue, nodes)
    series_points: int = 2000
    #: stop with an error after this many events (default 500 per job + 1M: only runaway evictions reach it)
    max_events: int | None = None


@dataclass
class Result:
    jobs: int
    finished: int
    makespan_s: float
    cost_usd: float | None
    cost_by_pool: dict[str, float | None]
    node_hours_by_pool: dict[str, float]
    gpu_utilization: float
    queue_p50_s: float
    queue_p99_s: float
    queue_mean_s: float
    lost_gpu_hours: float
    evictions: int
    preemptions: int
    scale_ups: int                  # nodes the autoscaler added (a 4-node gang's scale-up is 4)
    scale_downs: int                # nodes it removed as unneeded (evicted nodes are not counted)
    events: int
    wall_s: float
    start: np.ndarray = field(repr=False)
    end: np.ndarray = field(repr=False)
    series: dict[str, np.ndarray] = field(repr=False, default_factory=dict)

    def summary(self) -> dict:
        """The figures as plain JSON-able values."""
        return {
            "jobs": self.jobs, "finished": self.finished, "makespan_h": self.makespan_s / 3600,
            "cost_usd": self.cost_usd, "cost_by_pool": self.cost_by_pool, "node_hours_by_pool": self.node_hours_by_pool,
            "gpu_utilization": self.gpu_utilization, "queue_delay_p50_s": self.queue_p50_s,
            "queue_delay_p99_s": self.queue_p99_s, "queue_delay_mean_s": self.queue_mean_s,
            "lost_gpu_hours": self.lost_gpu_hours, "evictions": self.evictions, "preemptions": self.preemptions,
            "scale_ups": self.scale_ups, "scale_downs": self.scale_downs, "events": self.events, "wall_s": self.wall_s,
        }


def check_fits(trace: Trace, pools: list[Pool], autoscale: bool = True) -> dict[tuple[int, int], tuple[int, ...]]:
    """Eligible pools per (selector, toleration) signature; raises SimulationError naming the first job
    that no pool can ever hold (at max_nodes; without the autoscaler, at the nodes a pool starts with)."""
    sig_pools: dict[tuple[int, int], tuple[int, ...]] = {}
    for s, t in set(zip(trace.selector.tolist(), trace.toleration.tolist())):
        sig_pools[(s, t)] = tuple(eligible(pools, trace.selectors[s], trace.tolerations[t]))
    most = [p.max_nodes if autoscale else p.start_nodes for p in pools]
    cap = {sig: max((pools[p].node_gpus * most[p] for p in ps), default=0) for sig, ps in sig_pools.items()}
    need = np.fromiter((cap[(s, t)] for s, t in zip(trace.selector.tolist(), trace.toleration.tolist())), np.int64, len(trace))
    bad = np.nonzero(trace.gpus > need)[0]
    if len(bad):
        j = int(bad[0])
        sig = (int(trace.selector[j]), int(trace.toleration[j]))
        names = [pools[p].name for p in sig_pools[sig]]
        cpu_only = [p.name for p in pools if p.node_gpus < 1]
        if names and not autoscale:
            detail = (f"its eligible pools ({', '.join(names)}) start with at most {need[j]} GPUs and the autoscaler "
                      "is off (autoscaler.enabled: false)")
        elif names:
            detail = f"its eligible pools ({', '.join(names)}) hold at most {need[j]} GPUs"
        elif len(cpu_only) == len(pools):
            detail = f"no pool has GPUs ({', '.join(f'{p.name}: {p.sku}' for p in pools)})"
        else:
            detail = (f"no GPU pool matches its node selector {dict(trace.selectors[sig[0]])} and tolerations "
                      f"{list(trace.tolerations[sig[1]])}")
        raise SimulationError(
            f"job {trace.ids[j]!r} needs {int(trace.gpus[j])} GPUs and can never fit: {detail}"
            + (f" ({len(bad)} such jobs)" if len(bad) > 1 else ""),
            where=trace.source or None,
            fix=("turn the autoscaler on, or raise min_nodes (initial_nodes) of a pool" if names and not autoscale else
                 "add a pool of a GPU VM size (`azulite catalog --gpu A100` lists them)" if len(cpu_only) == len(pools) else
                 "raise max_nodes of a pool, add a pool it may use (labels/taints), or fix the job's gpus"),
        )
    return sig_pools
