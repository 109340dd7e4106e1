"""A discrete-event simulator of GPU node pools running a job trace.

What it models, and how (each choice is the Kubernetes / AKS behaviour of seed 001 §2 unless said):

- **Gang scheduling**: a job of G GPUs starts only when all of it fits at once, in one pool: on one node
  if G <= GPUs per node (best fit: the node with the fewest free GPUs that still fit), else on G // n
  whole free nodes plus one node for the remainder. Never partly.
- **Order**: pending jobs are tried by (priority desc, submit time asc); a job that does not fit does not
  block smaller ones behind it (as kube-scheduler, no reservation). Jobs are kept in buckets of equal
  (eligible pools, GPUs): once a bucket's head fails, the rest of that bucket would fail too, so a
  scheduling pass costs O(buckets), not O(queue).
- **Preemption**: a pending job that does not fit may evict running jobs of *lower* priority (whole
  jobs, as a gang) on one node / enough nodes of one pool; they lose their work since their last checkpoint
  and go back to the queue.
- **Cluster autoscaler**: pending jobs that fit nowhere ask for nodes in an eligible pool below its
  max (expander: least cost per GPU-hour, or pool order); new nodes are billed from the request and
  become schedulable after ``scale_up_delay``; a node idle for ``scale_down_unneeded_time`` is removed
  (not below ``min_nodes``, not within ``scale_down_delay_after_add`` of the pool's last scale-up).
- **Spot**: each spot node is evicted after an exponential time with the pool's rate; its jobs lose the
  work since their last checkpoint and are requeued; restarting costs ``restart_overhead`` seconds
  (restore) before progress resumes. A checkpointing job (interval tau, save cost delta) progresses at
  tau / (tau + delta) work-seconds per second.

Speed: one heapq of plain tuples (time, seq, kind, a, b), arrivals merged from the sorted trace (never
pushed), per-job state in flat Python lists, per-pool sets of nodes by free-GPU count; stale events are
skipped by epoch numbers instead of being removed.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from typing import Callable

import numpy as np

from azulite.cluster.pools import Pool
from azulite.cluster.simtypes import Result, Settings, check_fits
from azulite.cluster.trace import Trace
from azulite.errors import SimulationError

__all__ = ["Result", "Settings", "check_fits", "simulate"]

# event kinds
_FINISH, _READY, _EVICT, _IDLE = 0, 1, 2, 3
# job states
_PENDING, _RUNNING, _DONE, _NOT_YET = 0, 1, 2, 3


def simulate(trace: Trace, pools: list[Pool], settings: Settings | None = None,
             progress: Callable[[int, int, float], None] | None = None) -> Result:
    """Run ``trace`` on ``pools``; ``progress(finished, total, sim_time)`` is called now and then."""
    cfg = settings or Settings()
    wall0 = time.perf_counter()
    rng = random.Random(cfg.seed)
    sig_pools = check_fits(trace, pools, cfg.autoscale)
    n_jobs = len(trace)
    P = len(pools)

    # --- pools (preference order for placement and for the autoscaler's expander) ---------------------
    order = sorted(range(P), key=lambda p: (pools[p].usd_per_gpu_hour, p)) if cfg.least_cost else list(range(P))
    rank = {p: r for r, p in enumerate(order)}
    ngpu = [p.node_gpus for p in pools]
    levels: list[list[set[int]]] = [[set() for _ in range(max(g, 0) + 1)] for g in ngpu]  # ready nodes by free GPUs
    pool_nodes = [0] * P            # ready + provisioning
    last_up = [-math.inf] * P
    node_hours = [0.0] * P
    rate = [p.evictions_per_hour / 3600.0 for p in pools]

    # --- nodes -----------------------------------------------------------------------------------------
    n_pool: list[int] = []
    n_free: list[int] = []
    n_alive: list[bool] = []
    n_ready: list[bool] = []
    n_born: list[float] = []
    n_idle_epoch: list[int] = []
    n_jobs_on: list[dict[int, int]] = []   # job -> GPUs on this node
    n_waiters: list[list[int]] = []        # jobs whose scale-up request this node serves

    # --- jobs --------------------------------------------------------------------------------------------
    submit = trace.submit.tolist()
    gpus = trace.gpus.tolist()
    prio = trace.priority.tolist()
    tau = trace.checkpoint_interval.tolist()
    work = trace.duration.tolist()
    delta = cfg.checkpoint_cost
    speed = [(t / (t + delta)) if (delta > 0 and t != math.inf) else 1.0 for t in tau]
    key_of = []
    for s, t, g in zip(trace.selector.tolist(), trace.toleration.tolist(), gpus):
        key_of.append((tuple(sorted(sig_pools[(s, t)], key=rank.__getitem__)), g))
    state = [_NOT_YET] * n_jobs
    saved = [0.0] * n_jobs          # checkpointed work (survives eviction)
    run_start = [0.0] * n_jobs
    run_restore = [0.0] * n_jobs    # restore seconds at the start of the current run
    epoch = [0] * n_jobs
    awaiting = [False] * n_jobs
    placed: list[list[tuple[int, int]]] = [[] for _ in range(n_jobs)]
    first_start = np.full(n_jobs, np.nan)
    end = np.full(n_jobs, np.nan)
    restarted = [False] * n_jobs

    buckets: dict[tuple, list] = {}
    unserved: dict[tuple, int] = {}
    running_prio: dict[int, int] = {}
    heap: list[tuple] = []
    seq = 0
    now = 0.0
    busy = 0
    ready_gpus = 0
    pending = 0
    finished = 0
    events = 0
    lost_work_gpu_s = 0.0
    ready_gpu_s = 0.0
    t_acc = 0.0
    evictions = preemptions = scale_ups = scale_downs = 0
    # time series, sampled
    horizon = float(trace.submit[-1] + trace.duration.max()) if n_jobs else 1.0
    dt_rec = max(horizon / max(cfg.series_points, 1), 1e-9)
    next_rec = 0.0
    s_t: list[float] = []
    s_busy: list[int] = []
    s_queue: list[int] = []
    s_nodes: list[int] = []
    s_ready: list[int] = []

    def push(t: float, kind: int, a: int, b: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, a, b))

    def add_node(p: int, t_ready: float, waiters: list[int]) -> None:
        nid = len(n_pool)
        n_pool.append(p)
        n_free.append(ngpu[p])
        n_alive.append(True)
        n_ready.append(False)
        n_born.append(now)
        n_idle_epoch.append(0)
        n_jobs_on.append({})
        n_waiters.append(waiters)
        pool_nodes[p] += 1
        if t_ready <= now:
            node_ready(nid)
        else:
            push(t_ready, _READY, nid, 0)

    def node_ready(nid: int) -> None:
        nonlocal ready_gpus
        p = n_pool[nid]
        n_ready[nid] = True
        levels[p][ngpu[p]].add(nid)
        ready_gpus += ngpu[p]
        for j in n_waiters[nid]:
            if awaiting[j]:
                awaiting[j] = False
                if state[j] == _PENDING:
                    unserved[key_of[j]] = unserved.get(key_of[j], 0) + 1
        n_waiters[nid] = []
        if rate[p] > 0:
            push(now + rng.expovariate(rate[p]), _EVICT, nid, 0)
        mark_idle(nid)

    def mark_idle(nid: int) -> None:
        n_idle_epoch[nid] += 1
        if cfg.autoscale:
            push(now + cfg.scale_down_unneeded_time, _IDLE, nid, n_idle_epoch[nid])

    def remove_node(nid: int) -> None:
        nonlocal ready_gpus
        p = n_pool[nid]
        if n_ready[nid]:
            levels[p][n_free[nid]].discard(nid)
            ready_gpus -= ngpu[p]
        n_alive[nid] = False
        n_ready[nid] = False
        pool_nodes[p] -= 1
        node_hours[p] += (now - n_born[nid]) / 3600.0

    def enqueue(j: int) -> None:
        nonlocal pending
        state[j] = _PENDING
        k = key_of[j]
        b = buckets.get(k)
        if b is None:
            b = buckets[k] = []
        heapq.heappush(b, (-prio[j], submit[j], j))
        unserved[k] = unserved.get(k, 0) + (0 if awaiting[j] else 1)
        pending += 1
        dirty_keys.add(k)

    def fit(p: int, g: int) -> list[tuple[int, int]] | None:
        """Nodes of pool p that hold g GPUs now, or None."""
        ng = ngpu[p]
        lv = levels[p]
        if g <= ng:
            for k in range(g, ng + 1):
                if lv[k]:
                    return [(next(iter(lv[k])), g)]
            return None
        n_full, rem = divmod(g, ng)
        full = lv[ng]
        if len(full) < n_full:
            return None
        it = iter(full)
        chosen = [(next(it), ng) for _ in range(n_full)]
        if rem:
            for k in range(rem, ng):
                if lv[k]:
                    chosen.append((next(iter(lv[k])), rem))
                    return chosen
            if len(full) < n_full + 1:
                return None
            chosen.append((next(it), rem))
        return chosen

    def start(j: int, where: list[tuple[int, int]]) -> None:
        nonlocal busy, pending
        for nid, g in where:
            p = n_pool[nid]
            f = n_free[nid]
            levels[p][f].discard(nid)
            levels[p][f - g].add(nid)
            n_free[nid] = f - g
            n_jobs_on[nid][j] = g
            if f == ngpu[p]:
                n_idle_epoch[nid] += 1  # no longer idle: pending scale-down checks go stale
        busy += gpus[j]
        pending -= 1
        state[j] = _RUNNING
        placed[j] = where
        run_start[j] = now
        restore = cfg.restart_overhead if restarted[j] else 0.0
        run_restore[j] = restore
        if math.isnan(first_start[j]):
            first_start[j] = now
        running_prio[prio[j]] = running_prio.get(prio[j], 0) + 1
        epoch[j] += 1
        push(now + restore + (work[j] - saved[j]) / speed[j], _FINISH, j, epoch[j])

    def release(j: int) -> None:
        nonlocal busy
        for nid, g in placed[j]:
            if not n_alive[nid]:
                continue
            p = n_pool[nid]
            f = n_free[nid]
            levels[p][f].discard(nid)
            levels[p][f + g].add(nid)
            n_free[nid] = f + g
            del n_jobs_on[nid][j]
            if f + g == ngpu[p]:
                mark_idle(nid)
        placed[j] = []
        busy -= gpus[j]
        c = running_prio[prio[j]] - 1
        if c:
            running_prio[prio[j]] = c
        else:
            del running_prio[prio[j]]

    def interrupt(j: int) -> None:
        """Evicted or preempted: keep the checkpointed work, lose the rest, back to the queue."""
        nonlocal lost_work_gpu_s
        ran = max(0.0, now - run_start[j] - run_restore[j])
        done = saved[j] + ran * speed[j]
        kept = saved[j] if tau[j] == math.inf else max(saved[j], math.floor(done / tau[j]) * tau[j])
        lost_work_gpu_s += (now - run_start[j] - max(0.0, (kept - saved[j]) / speed[j])) * gpus[j]
        saved[j] = min(kept, work[j])
        release(j)
        epoch[j] += 1
        restarted[j] = True
        enqueue(j)

    def try_preempt(j: int, pool_ids: tuple[int, ...]) -> bool:
        """Evict lower-priority jobs so that ``j`` fits in one pool; the fewest GPUs evicted wins."""
        nonlocal preemptions
        pj, g = prio[j], gpus[j]
        for p in pool_ids:
            ng = ngpu[p]
            nodes = _ready_nodes(p)
            victims: list[int] = []
            if g <= ng:
                best = None
                for nid in nodes:
                    lower = sorted((v for v in n_jobs_on[nid] if prio[v] < pj), key=lambda v: (prio[v], -run_start[v]))
                    got, chosen = n_free[nid], []
                    for v in lower:
                        if got >= g:
                            break
                        chosen.append(v)
                        got += n_jobs_on[nid][v]
                    if got >= g and chosen:
                        c = (sum(gpus[v] for v in chosen), len(chosen))
                        if best is None or c < best[0]:
                            best = (c, chosen)
                if best is not None:
                    victims = best[1]
            else:
                whole = [nid for nid in nodes if all(prio[v] < pj for v in n_jobs_on[nid])]
                need = math.ceil(g / ng)
                if len(whole) < need:
                    continue
                whole.sort(key=lambda nid: -n_free[nid])
                for nid in whole[:need]:
                    victims.extend(n_jobs_on[nid])
            if not victims:
                continue
            for v in dict.fromkeys(victims):
                if state[v] == _RUNNING:
                    preemptions += 1
                    interrupt(v)
            where = fit(p, g)
            if where is not None:
                start(j, where)
                return True
        return False

    def _ready_nodes(p: int) -> list[int]:
        out: list[int] = []
        for s in levels[p]:
            out.extend(s)
        return out

    def scale_up(k: tuple) -> None:
        nonlocal scale_ups
        pool_ids, g = k
        if unserved.get(k, 0) <= 0:
            return
        for p in pool_ids:
            ng = ngpu[p]
            # a gang over several nodes counts the pool's wholly free nodes (e.g. the survivors of an eviction)
            per_job = math.ceil(g / ng) if g <= ng else max(1, math.ceil(g / ng) - len(levels[p][ng]))
            per_node = max(1, ng // g) if g <= ng else 1
            room = pools[p].max_nodes - pool_nodes[p]
            if room < per_job:
                continue
            waiting = [e[2] for e in buckets.get(k, ()) if not awaiting[e[2]]]
            waiting.sort(key=lambda j: (-prio[j], submit[j]))
            i = 0
            while i < len(waiting) and room >= per_job:
                if per_job == 1:
                    batch = waiting[i:i + per_node]
                    i += len(batch)
                    for j in batch:
                        awaiting[j] = True
                    unserved[k] -= len(batch)
                    add_node(p, now + cfg.scale_up_delay, batch)
                else:
                    j = waiting[i]
                    i += 1
                    awaiting[j] = True
                    unserved[k] -= 1
                    for m in range(per_job):
                        add_node(p, now + cfg.scale_up_delay, [j] if m == 0 else [])
                room = pools[p].max_nodes - pool_nodes[p]
                scale_ups += 1 if per_job == 1 else per_job  # nodes added, as scale_downs counts nodes removed
                last_up[p] = now
            if unserved.get(k, 0) <= 0:
                return

    def schedule(all_keys: bool) -> None:
        keys = list(buckets) if all_keys else [k for k in dirty_keys if k in buckets]
        cand = [(buckets[k][0], k) for k in keys if buckets[k]]
        heapq.heapify(cand)
        failed = []
        while cand:
            head, k = heapq.heappop(cand)
            j = head[2]
            g = gpus[j]
            where = None
            for p in k[0]:
                where = fit(p, g)
                if where is not None:
                    break
            if where is None:
                failed.append((head, k))
                continue
            heapq.heappop(buckets[k])
            if not awaiting[j]:
                unserved[k] -= 1
            awaiting[j] = False
            start(j, where)
            if buckets[k]:
                heapq.heappush(cand, (buckets[k][0], k))
        for head, k in failed:
            j = head[2]
            if running_prio and min(running_prio) < prio[j] and buckets[k] and buckets[k][0][2] == j:
                if try_preempt(j, k[0]):
                    heapq.heappop(buckets[k])
                    if not awaiting[j]:
                        unserved[k] -= 1
                    awaiting[j] = False
        for k in [k for k in buckets if not buckets[k]]:
            del buckets[k]
        if cfg.autoscale:
            for _, k in failed:
                if k in buckets:
                    scale_up(k)

    # --- initial nodes -------------------------------------------------------------------------------------
    for p, pool in enumerate(pools):
        for _ in range(pool.start_nodes):
            add_node(p, now, [])

    dirty_keys: set[tuple] = set()
    idle_checks: list[tuple[int, int]] = []
    ptr = 0
    capacity_changed = False
    last_t = 0.0
    next_progress = 0
    # a safety net, not a model limit: jobs evicted faster than they progress would never finish
    event_cap = cfg.max_events or 500 * n_jobs + 1_000_000
    while finished < n_jobs:
        if events > event_cap:
            raise SimulationError(
                f"the simulation does not converge: {n_jobs - finished} jobs still unfinished after {events:,} events "
                f"({evictions:,} spot evictions, {preemptions:,} preemptions)",
                fix="jobs are interrupted faster than they progress: lower eviction_rate_per_hour, checkpoint more "
                    "often (checkpoint_interval), or shorten restart_overhead")
        t_arr = submit[ptr] if ptr < n_jobs else math.inf
        t_ev = heap[0][0] if heap else math.inf
        t = t_arr if t_arr <= t_ev else t_ev
        if t == math.inf:
            raise SimulationError(  # check_fits rules this out unless spot evictions took nodes nothing replaces
                f"{n_jobs - finished} jobs can never start: spot evictions removed nodes and the autoscaler, which is "
                "off, does not replace them", fix="turn the autoscaler on (autoscaler.enabled: true), or use on-demand pools")
        # integrate busy/ready GPU-seconds over [last_t, t)
        dt = t - last_t
        if dt > 0:
            ready_gpu_s += ready_gpus * dt
            t_acc += busy * dt
            last_t = t
        now = t
        # every event at this instant, then one scheduling pass
        while ptr < n_jobs and submit[ptr] == now:
            enqueue(ptr)
            ptr += 1
            events += 1
        while heap and heap[0][0] == now:
            _, _, kind, a, b = heapq.heappop(heap)
            events += 1
            if kind == _FINISH:
                if state[a] != _RUNNING or epoch[a] != b:
                    continue
                release(a)
                state[a] = _DONE
                end[a] = now
                finished += 1
                capacity_changed = True
            elif kind == _READY:
                if n_alive[a]:
                    node_ready(a)
                    capacity_changed = True
            elif kind == _EVICT:
                if n_alive[a] and n_ready[a]:
                    evictions += 1
                    for j in list(n_jobs_on[a]):
                        if state[j] == _RUNNING:
                            interrupt(j)
                    remove_node(a)
                    capacity_changed = True
            elif kind == _IDLE:
                idle_checks.append((a, b))
        if pending and (capacity_changed or dirty_keys):
            schedule(capacity_changed)
        # scale-down after the pass: a node a pending job just took is not unneeded
        for a, b in idle_checks:
            if n_alive[a] and n_ready[a] and n_idle_epoch[a] == b and n_free[a] == ngpu[n_pool[a]]:
                p = n_pool[a]
                if pool_nodes[p] <= pools[p].min_nodes:
                    continue
                hold = last_up[p] + cfg.scale_down_delay_after_add
                if now < hold:
                    push(hold, _IDLE, a, b)
                    continue
                remove_node(a)
                scale_downs += 1
        idle_checks.clear()
        dirty_keys.clear()
        capacity_changed = False
        if now >= next_rec:  # the state from now on (a step plot's "post"), once this instant's events are done
            s_t.append(now)
            s_busy.append(busy)
            s_queue.append(pending)
            s_nodes.append(sum(pool_nodes))
            s_ready.append(ready_gpus)
            next_rec = now + dt_rec
        if progress is not None and events >= next_progress:
            progress(finished, n_jobs, now)
            next_progress = events + 16384
    # bill what is still up until the last job ends
    for nid in range(len(n_pool)):
        if n_alive[nid]:
            remove_node(nid)
    if progress is not None:
        progress(finished, n_jobs, now)
    s_t.append(now)
    s_busy.append(busy)
    s_queue.append(pending)
    s_nodes.append(0)
    s_ready.append(0)

    cost_by_pool: dict[str, float | None] = {}
    for p, pool in enumerate(pools):
        cost_by_pool[pool.name] = None if pool.usd_per_hour is None and node_hours[p] > 0 else (node_hours[p] * (pool.usd_per_hour or 0.0))
    total = None if any(v is None for v in cost_by_pool.values()) else sum(cost_by_pool.values())
    wait = first_start - trace.submit
    return Result(
        jobs=n_jobs, finished=finished, makespan_s=now - float(trace.submit[0]) if n_jobs else 0.0, cost_usd=total,
        cost_by_pool=cost_by_pool, node_hours_by_pool={pool.name: node_hours[p] for p, pool in enumerate(pools)},
        gpu_utilization=(t_acc / ready_gpu_s) if ready_gpu_s else 0.0,
        queue_p50_s=float(np.percentile(wait, 50)) if n_jobs else 0.0,
        queue_p99_s=float(np.percentile(wait, 99)) if n_jobs else 0.0,
        queue_mean_s=float(wait.mean()) if n_jobs else 0.0,
        lost_gpu_hours=lost_work_gpu_s / 3600.0, evictions=evictions, preemptions=preemptions,
        scale_ups=scale_ups, scale_downs=scale_downs, events=events, wall_s=time.perf_counter() - wall0,
        start=first_start, end=end,
        series={"t": np.asarray(s_t), "busy_gpus": np.asarray(s_busy), "queue": np.asarray(s_queue),
                "nodes": np.asarray(s_nodes), "ready_gpus": np.asarray(s_ready)},
    )
