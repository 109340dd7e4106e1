"""The planner: which SKU, how many nodes, spot or on-demand, and how often to checkpoint, for one job
whose run time was measured (or estimated) on a reference SKU and node count.

How a candidate's run time is scaled from the reference (assumptions, each a parameter):
- GPUs of another type only with a given relative speed (``speedup={"A100": 2.5}`` per GPU vs the
  reference's GPU type); without one, only SKUs of the reference's GPU type are weighed: azulite has no
  sourced cross-GPU speed figures and does not invent them;
- a candidate must have at least the reference's memory per GPU (the job's per-GPU footprint must fit);
- more than one node only on InfiniBand SKUs (seed 001 §1.5: multi-node training needs the RDMA fabric);
- time scales with 1 / (GPUs x speed) and loses ``scaling_efficiency`` per doubling of the GPU count.

Scoring is the simulator's (:mod:`azulite.cluster.sim`): each candidate runs as a one-job trace on a pool of
exactly its nodes; spot pools are evicted at ``eviction_rate`` per node-hour and the autoscaler brings a
replacement after ``scale_up_delay``; the job checkpoints every tau = sqrt(2 x delta x MTBF) (Young/Daly),
delta the measured save duration. Spot candidates run ``runs`` times (seeds 0..runs-1, the same for every
candidate); their mean, p10 and p90 give the expected cost and completion time and their spread.

Search: branch and bound. A candidate can never cost less than its compute alone (GPU time x price) nor
finish before its eviction-free run time, so candidates are simulated in order of that bound and the
search stops once no bound can beat the best simulated pick. Its pick is therefore the pick of an
exhaustive simulation of every candidate (``exhaustive=True`` does that; the tests compare the two).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from azulite.catalog import Catalog, Sku, load_catalog
from azulite.cluster.cost import DEFAULT_RESTART_SECONDS, CostError, young_daly_interval
from azulite.cluster.pools import Pool
from azulite.cluster.sim import Settings, simulate
from azulite.cluster.trace import Trace
from azulite.spec.cluster import DEFAULT_EVICTION_RATE_PER_HOUR

NODE_COUNTS = (1, 2, 4, 8, 16)


@dataclass
class Job:
    """The job to plan: ``hours`` of wall time measured on ``ref_nodes`` x ``ref_sku``."""

    hours: float
    ref_sku: Sku
    ref_nodes: int = 1
    save_seconds: float = 60.0
    save_source: str = "default"
    restart_seconds: float = DEFAULT_RESTART_SECONDS


@dataclass
class Candidate:
    sku: str
    node_gpus: int
    nodes: int
    spot: bool
    usd_per_node_hour: float | None
    compute_hours: float              # eviction-free, checkpoint-free run time
    bound_usd: float                  # compute_hours x nodes x price: nobody beats it
    checkpoint_interval_s: float | None = None
    simulated: bool = False
    cost_mean: float | None = None
    cost_p10: float | None = None
    cost_p90: float | None = None
    hours_mean: float | None = None
    hours_p90: float | None = None
    evictions_mean: float | None = None
    feasible: bool | None = None
    note: str = ""

    @property
    def label(self) -> str:
        return f"{self.nodes} x {self.sku.removeprefix('Standard_')} {'spot' if self.spot else 'on-demand'}"


@dataclass
class Plan:
    pick: Candidate | None
    candidates: list[Candidate]
    objective: str
    simulated: int
    assumptions: list[str] = field(default_factory=list)
    #: why there is no pick (empty when there is one)
    no_pick: str = ""


def gpu_speeds(ref: Sku, speedup: dict[str, float] | None, catalog: Catalog,
               clouds: tuple[str, ...] = ("azure",)) -> dict[str, float]:
    """Per-GPU speed of each GPU type weighed, relative to ``ref``'s (1): ``speedup``'s types matched to the
    catalog's names ignoring case. A type no SKU has, the reference's own type, or one type given twice is an
    error (each would be weighed silently otherwise, or halve every cost)."""
    if not ref.gpus:
        raise CostError(f"the reference SKU {ref.name} has no GPUs", fix="plan from a GPU SKU (resources.instance_type)")
    known = {s.gpu_type.lower(): s.gpu_type for s in catalog.skus() if s.gpus and s.gpu_type and s.cloud in clouds}
    others = ", ".join(sorted(set(known.values()) - {ref.gpu_type})) or "none"
    speeds = {ref.gpu_type: 1.0}
    for given, factor in (speedup or {}).items():
        name = known.get(given.strip().lower())
        if name is None:
            raise CostError(f"--speedup {given}={factor:g}: no SKU in the catalog has GPU type {given!r}",
                            fix=f"use one of: {others}; or add SKUs with --catalog FILE")
        if name == ref.gpu_type:
            raise CostError(f"--speedup {given}={factor:g}: {name} is the GPU type the run time was measured on "
                            "(speed 1 by definition)", fix=f"give other types' speed relative to it: {others}")
        if name in speeds:
            raise CostError(f"--speedup gives {name} twice", fix=f"give each GPU type once, e.g. --speedup {name}={factor:g}")
        if not 0 < factor < math.inf:
            raise CostError(f"--speedup {given}={factor:g}: the factor must be > 0", fix=f"e.g. --speedup {name}=2.5")
        speeds[name] = factor
    return speeds


def candidates(job: Job, catalog: Catalog, *, speedup: dict[str, float] | None = None, scaling_efficiency: float = 0.9,
               node_counts: tuple[int, ...] = NODE_COUNTS, clouds: tuple[str, ...] = ("azure",)) -> list[Candidate]:
    if not job.hours > 0:
        raise CostError(f"the job's hours must be > 0, got {job.hours:g}", fix="e.g. --hours 50")
    ref = job.ref_sku
    speeds = gpu_speeds(ref, speedup, catalog, clouds)
    ref_gpus = ref.gpus * job.ref_nodes
    out: list[Candidate] = []
    for sku in catalog.skus():
        if sku.cloud not in clouds or not sku.gpus or sku.gpu_type not in speeds:
            continue
        if sku.retired_by():  # no node of it can be had; the reference may be one (where the time was measured)
            continue
        for n in node_counts:
            g = sku.gpus * n
            note = ""
            if sku.gpu_memory_gb < ref.gpu_memory_gb:
                note = f"{sku.gpu_memory_gb:g} GB per GPU < the reference's {ref.gpu_memory_gb:g} GB"
            elif n > 1 and not sku.infiniband_gbps:
                note = "no InfiniBand: single node only"
            hours = job.hours * ref_gpus / (g * speeds[sku.gpu_type]) / scaling_efficiency ** math.log2(g / ref_gpus)
            for spot in (False, True):
                price = sku.price("spot" if spot else "on_demand")
                c = Candidate(sku.name, sku.gpus, n, spot, price.usd_per_hour if price else None, hours,
                              hours * n * price.usd_per_hour if price else math.inf, note=note)
                if price is None and not note:
                    c.note = f"{'spot' if spot else 'on-demand'} price unknown (no source)"
                out.append(c)
    return out


def score(c: Candidate, job: Job, *, eviction_rate: float, scale_up_delay: float, runs: int) -> Candidate:
    """Simulate candidate ``c`` (``runs`` seeds if spot) and fill in its expected cost and time."""
    lam = eviction_rate if c.spot else 0.0
    tau = young_daly_interval(job.save_seconds, 3600.0 / (lam * c.nodes)) if lam > 0 else math.inf
    c.checkpoint_interval_s = None if math.isinf(tau) else tau
    sku_gpus = c.node_gpus
    trace = Trace.from_columns(["job"], [0.0], [sku_gpus * c.nodes], [c.compute_hours * 3600.0],
                               checkpoint_interval=[tau])
    pool = Pool(name="plan", sku=c.sku, node_gpus=sku_gpus, usd_per_hour=c.usd_per_node_hour, price_label="",
                min_nodes=c.nodes, max_nodes=c.nodes, start_nodes=c.nodes, spot=c.spot, evictions_per_hour=lam)
    costs, hours, evs = [], [], []
    for seed in range(runs if lam > 0 else 1):
        r = simulate(trace, [pool], Settings(scale_up_delay=scale_up_delay, scale_down_unneeded_time=0.0,
                                             scale_down_delay_after_add=0.0, restart_overhead=job.restart_seconds,
                                             checkpoint_cost=job.save_seconds if lam > 0 else 0.0, seed=seed))
        costs.append(r.cost_usd)
        hours.append(r.makespan_s / 3600.0)
        evs.append(r.evictions)
    c.simulated = True
    c.cost_mean = float(np.mean(costs))
    c.cost_p10, c.cost_p90 = (float(x) for x in np.percentile(costs, [10, 90]))
    c.hours_mean = float(np.mean(hours))
    c.hours_p90 = float(np.percentile(hours, 90))
    c.evictions_mean = float(np.mean(evs))
    return c


def _feasible(c: Candidate, deadline_h: float | None, budget: float | None) -> bool:
    ok = True
    if deadline_h is not None:
        ok = ok and c.hours_p90 <= deadline_h
    if budget is not None:
        ok = ok and c.cost_mean <= budget
    return ok


def plan(job: Job, *, deadline_h: float | None = None, budget_usd: float | None = None, catalog: Catalog | None = None,
         eviction_rate: float = DEFAULT_EVICTION_RATE_PER_HOUR, scale_up_delay: float = 300.0, runs: int = 16,
         speedup: dict[str, float] | None = None, scaling_efficiency: float = 0.9,
         node_counts: tuple[int, ...] = NODE_COUNTS, exhaustive: bool = False) -> Plan:
    """The cheapest candidate whose p90 completion meets ``deadline_h`` (and whose expected cost fits
    ``budget_usd``); with only a budget, the fastest within it; with neither, the cheapest."""
    if deadline_h is not None and not deadline_h > 0:
        raise CostError(f"the deadline must be > 0 hours, got {deadline_h:g}", fix="e.g. --deadline 48h")
    if budget_usd is not None and not budget_usd > 0:
        raise CostError(f"the budget must be > 0 USD, got {budget_usd:g}", fix="e.g. --budget 500")
    cat = catalog or load_catalog()
    speeds = gpu_speeds(job.ref_sku, speedup, cat)  # for the assumptions; candidates() checks the same
    cands = candidates(job, cat, speedup=speedup, scaling_efficiency=scaling_efficiency, node_counts=node_counts)
    by_time = deadline_h is None and budget_usd is not None
    objective = ("fastest expected completion within the budget" if by_time else "lowest expected cost"
                 + (" with p90 completion within the deadline" if deadline_h is not None else "")
                 + (" and expected cost within the budget" if budget_usd is not None and not by_time else ""))
    usable = [c for c in cands if not c.note]
    for c in usable:
        if deadline_h is not None and c.compute_hours > deadline_h:
            c.note = f"needs {c.compute_hours:.1f} h without evictions > deadline"
        elif budget_usd is not None and c.bound_usd > budget_usd:
            c.note = f"compute alone ${c.bound_usd:,.0f} > budget"
    for c in usable:
        lam = eviction_rate * c.nodes / 3600.0 if c.spot else 0.0
        if lam > 0:
            tau = young_daly_interval(job.save_seconds, 1.0 / lam)
            # first-order share of time lost to evictions: near 1 the job (and its simulation) never ends
            if lam * (tau / 2 + job.restart_seconds + scale_up_delay) >= 0.9:
                c.note = f"evictions every {1 / lam / 60:.0f} min outpace progress"
    usable = [c for c in usable if not c.note]

    def bound(c: Candidate) -> tuple:
        return (c.compute_hours, c.bound_usd) if by_time else (c.bound_usd, c.compute_hours)

    def value(c: Candidate) -> tuple:
        return (c.hours_mean, c.cost_mean, c.nodes) if by_time else (c.cost_mean, c.hours_mean, c.nodes)

    best: Candidate | None = None
    simulated = 0
    for c in sorted(usable, key=bound):
        if not exhaustive and best is not None and bound(c)[0] >= value(best)[0]:
            c.note = "not simulated: its bound cannot beat the pick"
            continue
        score(c, job, eviction_rate=eviction_rate, scale_up_delay=scale_up_delay, runs=runs)
        simulated += 1
        c.feasible = _feasible(c, deadline_h, budget_usd)
        if c.feasible and (best is None or value(c) < value(best)):
            best = c
    assumptions = [
        f"run time measured: {job.hours:g} h on {job.ref_nodes} x {job.ref_sku.name}",
        f"checkpoint save delta = {job.save_seconds:g} s ({job.save_source}); restart {job.restart_seconds:g} s; "
        f"replacement node after {scale_up_delay:g} s",
        f"spot evictions {eviction_rate:g} per node-hour; scaling efficiency {scaling_efficiency:g} per doubling of GPUs",
        "GPU types weighed: " + ", ".join(f"{t} (x{v:g})" for t, v in sorted(speeds.items())),
    ]
    retired = [f"{s.short} (retired {s.retired})" for s in cat.skus() if s.gpu_type in speeds and s.retired_by()]
    if retired:
        assumptions.append("not weighed, no longer available: " + ", ".join(retired))
    return Plan(best, cands, objective, simulated, assumptions,
                no_pick="" if best is not None else _why_no_pick(cands, deadline_h, budget_usd))


#: notes of candidates ruled out before any constraint was weighed: the hardware, or no price
_NOT_WEIGHED = ("price unknown", "GB per GPU <", "no InfiniBand", "outpace progress")


def _why_no_pick(cands: list[Candidate], deadline_h: float | None, budget: float | None) -> str:
    """What kept every candidate out: none could be weighed (each note says why), or the deadline / budget,
    with the fastest / cheapest candidate and its figure (they were weighed; none met them)."""
    weighed = [c for c in cands if not any(n in c.note for n in _NOT_WEIGHED)]
    if not weighed:
        unpriced = all("price unknown" in c.note for c in cands)
        return "no candidate could be weighed: " + (
            "no price is known for any candidate (see the notes below); add prices with --catalog FILE, or weigh "
            "other GPU types with --speedup TYPE=FACTOR" if unpriced else "each is ruled out by the note beside it below")
    said = []
    if deadline_h is not None:
        def hours(c: Candidate) -> float:
            return c.hours_p90 if c.simulated else c.compute_hours

        fastest = min(weighed, key=hours)
        if hours(fastest) > deadline_h:
            how = f"p90 {fastest.hours_p90:.1f} h" if fastest.simulated else f"{fastest.compute_hours:.1f} h without evictions"
            said.append(f"none finishes within the deadline of {deadline_h:g} h: the fastest, {fastest.label}, needs {how}")
    if budget is not None:
        def usd(c: Candidate) -> float:
            return c.cost_mean if c.simulated else c.bound_usd

        cheapest = min(weighed, key=usd)
        if usd(cheapest) > budget:
            how = f"an expected ${cheapest.cost_mean:,.2f}" if cheapest.simulated else f"${cheapest.bound_usd:,.2f} for compute alone"
            said.append(f"none fits the budget of ${budget:,.2f}: the cheapest, {cheapest.label}, costs {how}")
    if not said:  # each meets one constraint, none both
        said.append("no candidate meets the deadline and the budget together")
    return "; ".join(said)
