"""The cost model: training (nodes x hours x the price that applies, plus the expected cost of spot
evictions) and serving (always-on, autoscaled by a request-rate curve, scale-to-zero), every figure with
the price's source and every assumption spelled out.

Spot evictions (the exponential-failure model Young's and Daly's checkpoint intervals come from, taken
exactly rather than to first order): a job on n nodes is interrupted at rate L = n x lambda; its T0 of work
runs in segments of tau (the checkpoint interval; the last one is what remains, min(tau, remaining work)),
each but the last followed by a checkpoint save of delta. An eviction loses the segment's progress and costs
the restart (restore) time R (itself not evicted: a second-order term while R << MTBF), then the segment
runs again. A segment of length w (its work plus its save) is expected to take

    E[T_w] = (1/L + R) x (e^(L w) - 1)

and the job the sum over its segments; its spread is the sum of the segments' variances (the number of
tries is geometric, each lost try a truncated exponential plus R). An interval >= the job is no checkpoint:
an eviction restarts it from scratch. tau = sqrt(2 x delta x MTBF) (Young/Daly) when not given, MTBF = 1/L.
A job whose expected wall time is more than 1 / MIN_PROGRESS_SHARE times its work is expected never to
finish (evictions outpace progress): an error, not a number.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from azulite.catalog import PRICE_KINDS, Sku
from azulite.errors import CostError, PriceUnknown
from azulite.spec.cluster import DEFAULT_EVICTION_RATE_PER_HOUR, DEFAULT_EVICTION_RATE_SOURCE

#: Save duration assumed when no checkpoint manifest gives a measured one (seconds).
DEFAULT_SAVE_SECONDS = 60.0
#: Restore-and-restart time after an eviction when not given (seconds).
DEFAULT_RESTART_SECONDS = 300.0
HOURS_PER_MONTH = 730.0  # 8,760 h / 12; the other common convention is 720 (30 days)
#: below this share of its wall time spent on new work (over 90% redoing lost work and restarting), a spot
#: job is "expected never to finish": a figure of millions of hours would read as a price
MIN_PROGRESS_SHARE = 0.1


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young/Daly's first-order optimum checkpoint interval tau = sqrt(2 x delta x MTBF) (seconds)."""
    if not save_seconds > 0:
        raise CostError(f"a checkpoint save takes time: --save-seconds must be > 0, got {save_seconds:g}",
                        fix="pass the save duration measured in the checkpoint manifests, e.g. --save-seconds 60")
    if not mtbf_seconds > 0:
        raise CostError(f"Young/Daly needs a mean time between evictions > 0, got {mtbf_seconds:g} s",
                        fix="an eviction rate > 0 per node-hour, e.g. --eviction-rate 0.01")
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def price_of(sku: Sku, kind: str) -> float:
    p = sku.price(kind)
    if p is None:
        known = [k for k in PRICE_KINDS if sku.price(k)]
        raise PriceUnknown(
            f"no {kind} price for {sku.name}: no source gives one",
            fix=(f"known for this SKU: {', '.join(known)}; or add" if known else "add") + " a [[price]] with its source in a --catalog file",
        )
    return p.usd_per_hour


@dataclass
class TrainingCost:
    sku: str
    nodes: int
    pricing: str
    usd_per_node_hour: float
    price_source: str
    compute_hours: float            # T0: wall hours without evictions or checkpoint overhead
    expected_hours: float           # T: with checkpoint saves and expected evictions
    compute_usd: float              # T0 x nodes x price
    checkpoint_overhead_usd: float
    eviction_overhead_usd: float
    total_usd: float
    expected_evictions: float = 0.0
    evictions_per_node_hour: float = 0.0
    checkpoint_interval_s: float | None = None
    save_seconds: float | None = None
    restart_seconds: float | None = None
    hours_sd: float = 0.0           # spread of the completion time (eviction count is Poisson)
    assumptions: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        d["breakdown"] = {
            "compute_usd": self.compute_usd, "checkpoint_overhead_usd": self.checkpoint_overhead_usd,
            "eviction_overhead_usd": self.eviction_overhead_usd,
            "formula": f"{self.nodes} nodes x {self.expected_hours:.4g} h x ${self.usd_per_node_hour:g}/node-hour",
        }
        return d


def training_cost(
    sku: Sku, nodes: int, hours: float, *, pricing: str = "on_demand", eviction_rate: float | None = None,
    checkpoint_interval_s: float | None = None, save_seconds: float | None = None,
    restart_seconds: float | None = None,
) -> TrainingCost:
    """Cost of ``hours`` of wall time on ``nodes`` x ``sku`` at ``pricing`` (a PRICE_KINDS name). For spot,
    ``eviction_rate`` (per node-hour) defaults to the labelled assumption; 0 prices spot without evictions."""
    if nodes < 1:
        raise CostError(f"nodes must be >= 1, got {nodes}", fix="e.g. --nodes 2")
    if not (hours > 0) or math.isinf(hours):
        raise CostError(f"hours must be > 0, got {hours:g}", fix="give the job's wall time, e.g. --hours 50")
    if pricing not in PRICE_KINDS:
        raise CostError(f"unknown pricing {pricing!r}", fix=f"use one of: {', '.join(PRICE_KINDS)}")
    rate = price_of(sku, pricing)
    source = sku.price(pricing).label()
    assumptions: list[str] = []
    t0 = hours
    compute = t0 * nodes * rate
    if pricing != "spot":
        return TrainingCost(sku.name, nodes, pricing, rate, source, t0, t0, compute, 0.0, 0.0, compute, assumptions=assumptions)
    lam = DEFAULT_EVICTION_RATE_PER_HOUR if eviction_rate is None else eviction_rate
    if eviction_rate is None:
        assumptions.append(f"spot eviction rate {lam:g}/node-hour: {DEFAULT_EVICTION_RATE_SOURCE}")
    if lam < 0:
        raise CostError(f"eviction rate must be >= 0, got {lam:g}", fix="e.g. --eviction-rate 0.01")
    if lam == 0:
        assumptions.append("no spot evictions (eviction rate 0): the seeds' spot figures assume this")
        return TrainingCost(sku.name, nodes, pricing, rate, source, t0, t0, compute, 0.0, 0.0, compute,
                            evictions_per_node_hour=0.0, assumptions=assumptions)
    delta = DEFAULT_SAVE_SECONDS if save_seconds is None else save_seconds
    if save_seconds is None:
        assumptions.append(f"checkpoint save takes {delta:g} s (default; no measured save_seconds given)")
    restart = DEFAULT_RESTART_SECONDS if restart_seconds is None else restart_seconds
    if restart_seconds is None:
        assumptions.append(f"restore and restart after an eviction take {restart:g} s (default)")
    big_l = lam * nodes / 3600.0  # interruptions per second
    tau = checkpoint_interval_s or young_daly_interval(delta, 1.0 / big_l)
    work_s = t0 * 3600.0
    if tau >= work_s:
        how = "given" if checkpoint_interval_s else f"Young/Daly's {tau / 60:.1f} min"
        assumptions.append(f"no checkpoint: the interval ({how}) is not shorter than the job's {t0:g} h of work, "
                           "so an eviction restarts it from scratch")
    elif checkpoint_interval_s is None:
        assumptions.append(f"checkpoint every {tau / 60:.1f} min (Young/Daly: sqrt(2 x {delta:g} s x MTBF {1 / big_l / 3600:.1f} h))")
    run = spot_run(work_s, big_l, tau, delta, restart)
    t = run.mean_s / 3600.0
    if not t0 / t >= MIN_PROGRESS_SHARE:  # inf or NaN included
        raise CostError(
            f"with {lam:g} evictions per node-hour on {nodes} node{'' if nodes == 1 else 's'} the job is expected never to finish "
            f"(an eviction every {_minutes(1 / big_l)}, against {_minutes(run.longest_s)} of work and save between checkpoints: "
            f"{'under 0.1' if not t0 / t >= 0.001 else format(100 * t0 / t, '.2g')}% of the time would be progress)",
            fix="use fewer nodes, on-demand nodes, or checkpoint more often (--checkpoint-interval)",
        )
    base = t0 + run.saves * delta / 3600.0
    ckpt_usd = (base - t0) * nodes * rate
    evict_usd = (t - base) * nodes * rate
    return TrainingCost(
        sku.name, nodes, pricing, rate, source, t0, t, compute, ckpt_usd, evict_usd, t * nodes * rate,
        expected_evictions=run.evictions, evictions_per_node_hour=lam, checkpoint_interval_s=tau, save_seconds=delta,
        restart_seconds=restart, hours_sd=math.sqrt(run.var_s2) / 3600.0, assumptions=assumptions,
    )


@dataclass(frozen=True)
class SpotRun:
    """A job's wall time under evictions (seconds): its mean and variance, the expected evictions, the
    checkpoint saves it makes and its longest segment (work plus save) between checkpoints."""

    mean_s: float
    var_s2: float
    evictions: float
    saves: int
    longest_s: float


def spot_run(work_s: float, rate_per_s: float, interval_s: float, save_s: float, restart_s: float) -> SpotRun:
    """``work_s`` of work interrupted at ``rate_per_s``, checkpointed every ``interval_s`` of work (a save of
    ``save_s`` after every segment but the last; none when the interval is not shorter than the work), each
    interruption costing ``restart_s`` and the segment's progress. Summed in closed form over the segments
    (all full ones alike, then the remainder)."""
    if not (work_s > 0 and rate_per_s > 0 and interval_s > 0 and save_s >= 0 and restart_s >= 0):
        raise CostError(f"cannot model spot evictions of {work_s:g} s of work at {rate_per_s:g}/s every {interval_s:g} s",
                        fix="give hours, an eviction rate and a checkpoint interval > 0")
    n = max(1, math.ceil(work_s / interval_s))
    last = work_s - (n - 1) * interval_s
    full = _segment(rate_per_s, interval_s + save_s, restart_s) if n > 1 else (0.0, 0.0, 0.0)
    end = _segment(rate_per_s, last, restart_s)
    k = n - 1
    return SpotRun(k * full[0] + end[0], k * full[1] + end[1], k * full[2] + end[2], k,
                   interval_s + save_s if n > 1 else last)


def _segment(lam: float, w: float, r: float) -> tuple[float, float, float]:
    """(mean, variance, expected evictions) of the time to get through ``w`` seconds without an eviction at
    rate ``lam``, each eviction costing ``r`` and what was done of ``w``: the tries are geometric (success
    e^(-lam w)), a lost one takes an exponential truncated at w, plus r."""
    x = lam * w
    if x > 700:  # e^x overflows a float: no figure, and far past MIN_PROGRESS_SHARE
        return math.inf, math.inf, math.inf
    m = math.expm1(x)                                    # expected evictions, e^x - 1
    mean = (1.0 / lam + r) * m
    if x < 1e-3:  # the closed forms below cancel: their series
        lost_mean = w * (0.5 - x / 12.0)
        lost_var = w * w * (1.0 / 12.0 - x * x / 240.0)
    else:
        lost_mean = w * (1.0 / x - 1.0 / m)              # E[X | X < w]
        lost_var = w * w * (1.0 / (x * x) - (m + 1.0) / (m * m))  # Var[X | X < w]
    y = lost_mean + r
    var = m * lost_var + m * (m + 1.0) * y * y          # E[N] Var[Y] + Var[N] E[Y]^2
    return mean, var, m


def _minutes(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.2g} s"
    if seconds < 600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.3g} h"


#: the longest month (31 days): more hours per month is a typo, not a convention
MAX_HOURS_PER_MONTH = 744.0


@dataclass
class ServingCost:
    sku: str
    pricing: str
    mode: str
    usd_per_node_hour: float
    price_source: str
    hours_per_month: float
    replica_hours_per_month: float
    monthly_usd: float
    computation: str
    assumptions: list[str] = field(default_factory=list)
    hourly_replicas: list[int] | None = None

    @property
    def total_usd(self) -> float:
        return self.monthly_usd

    def to_json(self) -> dict:
        return asdict(self) | {"total_usd": self.monthly_usd}


def serving_cost(
    sku: Sku, *, mode: str = "always-on", pricing: str = "on_demand", replicas: int = 1,
    hours_per_month: float = HOURS_PER_MONTH, utilization: float | None = None,
    curve: list[float] | None = None, capacity_rps: float | None = None, max_replicas: int | None = None,
) -> ServingCost:
    """Monthly cost of an endpoint on ``sku``.

    - ``always-on``: ``replicas`` all month;
    - ``autoscale`` (min 1 replica): from a request-rate ``curve`` (req/s per hour of a day, repeated) and
      the ``capacity_rps`` of one replica, or from a mean ``utilization`` (the share of hours a replica runs);
    - ``scale-to-zero``: like autoscale with min 0: hours with no traffic cost nothing.
    """
    if not 0 < hours_per_month <= MAX_HOURS_PER_MONTH:
        raise CostError(f"hours per month must be > 0 and at most {MAX_HOURS_PER_MONTH:g} (31 days), got {hours_per_month:g}",
                        fix="730 (8,760/12) or 720 (30 days)")
    # an input the mode does not use would be dropped without a word: the user meant something else
    if mode == "always-on" and (curve is not None or utilization is not None or capacity_rps is not None):
        raise CostError("always-on runs every replica all month: a curve, a capacity or a utilization would not count",
                        fix="add --mode autoscale (or scale-to-zero) to price by them, or drop them")
    if curve is not None and utilization is not None:
        raise CostError("give a request-rate curve or a utilization, not both",
                        fix="--curve FILE --capacity RPS prices hour by hour; --utilization a mean share of hours")
    if capacity_rps is not None and curve is None:
        raise CostError("--capacity is the req/s of one replica against a request-rate curve, and there is none",
                        fix="add --curve FILE (rows of hour,rps), or drop --capacity")
    if replicas < 1:
        raise CostError(f"replicas must be >= 1, got {replicas}", fix="e.g. --nodes 1 (replicas)")
    rate = price_of(sku, pricing)
    source = sku.price(pricing).label()
    notes = [f"{hours_per_month:g} hours per month"]
    hourly = None
    if mode == "always-on":
        rh = replicas * hours_per_month
        comp = f"{replicas} x {hours_per_month:g} h x ${rate:g}/h"
    elif mode in ("autoscale", "scale-to-zero"):
        floor_ = 1 if mode == "autoscale" else 0
        if curve is not None:
            if not curve or not all(0 <= r < math.inf for r in curve):
                raise CostError("the request-rate curve needs one finite rate >= 0 per hour", fix="a CSV of hour,rps rows")
            if capacity_rps is None or not 0 < capacity_rps < math.inf:
                raise CostError("a request-rate curve needs the capacity of one replica (req/s, > 0)",
                                fix="pass --capacity RPS, e.g. --capacity 50")
            need = [max(floor_, math.ceil(r / capacity_rps - 1e-9)) for r in curve]
            cap = max_replicas or max(need)
            hourly = [min(cap, n) for n in need]
            rh = sum(hourly) / len(hourly) * hours_per_month
            comp = f"mean {sum(hourly) / len(hourly):.3g} replicas over the {len(hourly)}-hour curve x {hours_per_month:g} h x ${rate:g}/h"
            notes.append(f"one replica serves {capacity_rps:g} req/s; min {floor_} replica(s), max {cap}")
            short = sum(1 for n in need if n > cap)
            if short:
                notes.append(f"{short} of {len(need)} hours need more than {cap} replicas (up to {max(need)}): "
                             "priced at the max, and those hours are over capacity")
        elif utilization is not None:
            if not 0 <= utilization <= 1:
                raise CostError(f"utilization must be within [0, 1], got {utilization:g}", fix="e.g. --utilization 0.5")
            # min 1 replica (autoscale) never runs less than 1 of the max replicas
            share = utilization if floor_ == 0 else max(utilization, 1.0 / replicas)
            rh = replicas * hours_per_month * share
            comp = f"{replicas} x {hours_per_month:g} h x {share:g} (running share) x ${rate:g}/h"
            notes.append(f"replicas run {share:.0%} of the hours"
                         + (f" (min 1 of {replicas} replicas never stops: {utilization:.0%} asked)" if share > utilization else ""))
        else:
            raise CostError(f"{mode} needs a request-rate curve (--curve FILE --capacity RPS) or --utilization",
                            fix="e.g. --utilization 0.5")
    else:
        raise CostError(f"unknown serving mode {mode!r}", fix="use always-on, autoscale or scale-to-zero")
    return ServingCost(sku.name, pricing, mode, rate, source, hours_per_month, rh, rh * rate, comp, notes, hourly)
