"""``azulite cost``, ``azulite simulate`` and ``azulite plan``: thin shells over :mod:`azulite.cluster`
(flags -> typed inputs, rich tables for people, ``--json`` for scripts)."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from azulite.cli.console import check_output_file
from azulite.cli.console import err as err_console
from azulite.errors import CostError, PriceUnknown, SpecError, TraceError


def _console() -> Console:
    out = Console(highlight=False)
    if not out.is_terminal:
        out.width = 200
    return out


_UNIT_S = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_COMPOUND = re.compile(r"^(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


def _duration_s(text: str) -> float:
    """Seconds of ``90m``, ``2d``, ``3600`` (spec durations) or a compound ``1h30m`` / ``1d 12h`` (units
    largest first, each once); ValueError otherwise, and for <= 0 or not finite."""
    from azulite.spec.job import parse_duration

    squeezed = "".join(text.split()).lower()
    m = _COMPOUND.match(squeezed)
    if m and sum(g is not None for g in m.groups()) > 1:
        seconds = sum(float(g) * u for g, u in zip(m.groups(), _UNIT_S.values()) if g is not None)
        if not 0 < seconds < math.inf:
            raise ValueError(text)
        return seconds
    return parse_duration(text)


def _hours(value: Optional[str], flag: str) -> Optional[float]:
    if value is None:
        return None
    try:
        text = value.strip()
        number = _number(text)  # 50, 2.5, 1e3 (hours)
        if number is not None:
            if not 0 < number < math.inf:
                raise ValueError(text)
            return number
        return _duration_s(text) / 3600.0
    except (ValueError, IndexError):
        raise SpecError(f"takes hours (50, 2.5) or a duration (90m, 1h30m, 2d), > 0, got {value!r}",
                        field=flag, fix=f"e.g. {flag} 48") from None


def _seconds(value: Optional[str], flag: str) -> Optional[float]:
    if value is None:
        return None
    try:
        return _duration_s(value)
    except ValueError:
        raise SpecError(f"takes seconds or a duration (30m, 1h30m), > 0, got {value!r}", field=flag,
                        fix=f"e.g. {flag} 30m") from None


def _nodes(value: Optional[int], flag: str = "--nodes") -> Optional[int]:
    if value is not None and value < 1:  # the cost model's "nodes must be >= 1" named no flag
        raise SpecError(f"must be >= 1 (nodes for training, the most replicas with --serve), got {value}", field=flag,
                        fix=f"e.g. {flag} 2") from None
    return value


def _job_facts(spec_path: Path) -> tuple[Optional[str], int, bool]:
    """(instance_type, nodes, spot) of a job spec."""
    from azulite.spec.loader import load_job

    spec = load_job(spec_path)
    props = spec.resources.properties or {}
    low = str((props.get("AmlCompute") or {}).get("vmPriority", "")).lower() == "lowpriority"
    return spec.resources.instance_type, spec.nodes, spec.priority == "spot" or low


def _work_hours(hours: Optional[str], sps: Optional[float], samples: Optional[float], epochs: float) -> float:
    if hours is not None:
        if sps is not None or samples is not None:  # else one of them is silently ignored
            raise CostError("give --hours or --samples-per-second/--samples, not both",
                            fix="drop one: --hours is the wall time; the samples flags compute it")
        return _hours(hours, "--hours")
    if sps is not None and samples is not None:
        if not all(0 < v < math.inf for v in (sps, samples, epochs)):
            raise CostError("--samples-per-second, --samples and --epochs must be > 0", fix="e.g. --samples-per-second 1200 --samples 443757 --epochs 100")
        return samples * epochs / sps / 3600.0
    raise CostError("how long does the job run? give --hours, or --samples-per-second with --samples and --epochs",
                    fix="e.g. --hours 50, or --samples-per-second 250 --samples 443757 --epochs 100")


def cost(
    spec: Optional[Path] = typer.Argument(None, help="A job spec: SKU, nodes and spot come from it.", show_default=False),
    sku: Optional[str] = typer.Option(None, "--sku", help="VM size, e.g. Standard_NC24rs_v3 (overrides the spec)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Nodes (training) or replicas (serving)."),
    hours: Optional[str] = typer.Option(None, "--hours", help="Wall time: 50, 2.5, 90m, 1h30m, 2d."),
    samples_per_second: Optional[float] = typer.Option(None, "--samples-per-second", help="Measured training throughput."),
    samples: Optional[float] = typer.Option(None, "--samples", help="Dataset size (samples per epoch)."),
    epochs: float = typer.Option(1.0, "--epochs", help="Epochs (with --samples-per-second and --samples)."),
    spot: bool = typer.Option(False, "--spot", help="Spot (low-priority) VMs, with the expected eviction overhead."),
    pricing: Optional[str] = typer.Option(None, "--pricing", help="on_demand (default; spot for a spot job spec), reserved_1y, reserved_3y, savings_1y, savings_3y.", show_default=False),
    eviction_rate: Optional[float] = typer.Option(None, "--eviction-rate", help="Spot evictions per node-hour (0: none)."),
    save_seconds: Optional[float] = typer.Option(None, "--save-seconds", help="Checkpoint save duration (s)."),
    checkpoint_interval: Optional[str] = typer.Option(None, "--checkpoint-interval", help="Default: Young/Daly."),
    serve: bool = typer.Option(False, "--serve", help="Price an always-on / autoscaled endpoint per month instead."),
    mode: str = typer.Option("always-on", "--mode", help="Serving: always-on, autoscale, scale-to-zero."),
    hours_per_month: float = typer.Option(730.0, "--hours-per-month", help="Serving: 730 (8,760/12) or 720."),
    utilization: Optional[float] = typer.Option(None, "--utilization", help="Serving: share of hours replicas run."),
    curve: Optional[Path] = typer.Option(None, "--curve", help="Serving: CSV of hour,rps (a day's request rate)."),
    capacity: Optional[float] = typer.Option(None, "--capacity", help="Serving: req/s one replica handles."),
    catalog_file: Optional[Path] = typer.Option(None, "--catalog", help="A TOML catalog file (your SKUs / prices)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object with total_usd and the breakdown."),
) -> None:
    """What a training job or an endpoint costs, with the price's source and every assumption.

    Examples:

      azulite cost --sku Standard_NC24rs_v3 --nodes 2 --hours 50

      azulite cost --sku NC24rs_v3 --nodes 2 --hours 50 --spot --eviction-rate 0 --json

      azulite cost examples/ddp/job.yaml --hours 10

      azulite cost --serve --sku NC4as_T4_v3 --hours-per-month 720
    """
    from azulite.catalog import load_catalog
    from azulite.cluster.cost import serving_cost, training_cost

    nodes = _nodes(nodes)
    cat = load_catalog(str(catalog_file) if catalog_file else None)
    spec_sku, spec_nodes, spec_spot = (None, 1, False)
    if spec is not None:
        spec_sku, spec_nodes, spec_spot = _job_facts(spec)
    name = sku or spec_sku
    if not name:
        raise CostError("which VM size? " + ("the spec has no resources.instance_type" if spec is not None else "no --sku and no job spec"),
                        fix="pass --sku, e.g. --sku Standard_NC24rs_v3, or a job spec: azulite cost examples/ddp/job.yaml --hours 10")
    the_sku = cat.get(name)
    if spot and pricing not in (None, "spot"):  # --spot won and --pricing was dropped without a word
        raise CostError(f"--spot and --pricing {pricing} ask for two prices", fix=f"pick one: --spot, or --pricing {pricing}")
    # a spot job spec is priced as spot unless --pricing says otherwise (then that price, on-demand included)
    kind = "spot" if spot else pricing or ("spot" if spec_spot else "on_demand")
    out = _console()
    retired = the_sku.retirement()
    warnings = [retired] if retired else []
    for w in warnings:  # priced all the same (a what-if, or a bill to check), but said
        err_console().print(f"warning: {w}", markup=False)
    if serve:
        if hours is not None or samples_per_second is not None or samples is not None:  # they were ignored
            raise CostError("--hours and the samples flags price a training run, not an endpoint",
                            fix="for --serve give --hours-per-month (730 or 720), or drop --serve to price training")
        from azulite.cluster.curve import read_curve

        rates = read_curve(curve) if curve else None
        # `nodes or 1` would price `--nodes 0` as one replica without a word; 0 is the user's typo to report
        # with a curve, --nodes is the most replicas the autoscaler may run (unbounded when not given)
        result = serving_cost(the_sku, mode=mode, pricing=kind, replicas=1 if nodes is None else nodes, hours_per_month=hours_per_month,
                              utilization=utilization, curve=rates, capacity_rps=capacity,
                              max_replicas=nodes if rates is not None else None)
        if as_json:
            print(json.dumps(result.to_json() | {"warnings": warnings}, indent=2))
            return
        out.print(f"[bold]{result.sku}[/] endpoint, {mode}: [bold]${result.monthly_usd:,.2f}[/] per month")
        out.print(f"  = {result.computation}")
        out.print(f"  price: ${result.usd_per_node_hour:g}/h — {result.price_source}")
        for a in result.assumptions:
            out.print(f"  assumes: {a}")
        if mode == "always-on":
            per = result.monthly_usd / result.hours_per_month
            out.print("  hours-per-month conventions: " + "; ".join(
                f"{h:g} h -> ${per * h:,.2f}" for h in (720.0, 730.0)) + " (pick with --hours-per-month)")
        return
    n = spec_nodes if nodes is None else nodes
    h = _work_hours(hours, samples_per_second, samples, epochs)
    same = dict(eviction_rate=eviction_rate, checkpoint_interval_s=_seconds(checkpoint_interval, "--checkpoint-interval"),
                save_seconds=save_seconds)
    est = training_cost(the_sku, n, h, pricing=kind, **same)
    alternatives: dict[str, Optional[float]] = {}
    why_not: dict[str, str] = {}  # a price that exists but cannot be applied (spot that never finishes)
    for k in ("on_demand", "spot", "savings_1y", "savings_3y", "reserved_1y", "reserved_3y"):
        try:
            alternatives[k] = training_cost(the_sku, n, h, pricing=k, **same).total_usd
        except PriceUnknown:
            alternatives[k] = None
        except CostError as exc:  # its reason, without the figures the headline's own error gives in full
            alternatives[k], why_not[k] = None, exc.message.split(" (")[0]
    if as_json:
        print(json.dumps(est.to_json() | {"alternatives_usd": alternatives, "alternatives_not_priced": why_not,
                                          "warnings": warnings}, indent=2))
        return
    out.print(f"[bold]{n} x {est.sku}[/], {h:g} h, {kind}: [bold]${est.total_usd:,.2f}[/]")
    out.print(f"  compute {n} x {h:g} h x ${est.usd_per_node_hour:g}/node-hour = ${est.compute_usd:,.2f}  ({est.price_source})")
    if kind == "spot" and est.evictions_per_node_hour:
        out.print(f"  + checkpoint saves ${est.checkpoint_overhead_usd:,.2f} + expected evictions ({est.expected_evictions:.2f}) "
                  f"${est.eviction_overhead_usd:,.2f}; completion {est.expected_hours:.1f} h ± {est.hours_sd:.1f} h")
    for a in est.assumptions:
        out.print(f"  assumes: {a}")
    table = Table(title="Same job, other prices", title_justify="left")
    table.add_column("pricing")
    table.add_column("total", justify="right")
    for k, v in alternatives.items():
        table.add_row(k, f"${v:,.2f}" if v is not None else why_not.get(k, "unknown (no source)"))
    out.print(table)


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def simulate_cmd(
    cluster: Path = typer.Argument(..., help="Cluster spec (YAML: pools, autoscaler)."),
    trace: Path = typer.Argument(..., help="Job trace (CSV, or --format philly / pai2020 / pai2023)."),
    fmt: str = typer.Option("csv", "--format", help="csv, philly (cluster_job_log), pai2020 (task table), pai2023 (pod list)."),
    job_table: Optional[Path] = typer.Option(None, "--job-table", help="pai2020: pai_job_table.csv for submit times."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of utilization, queue and nodes here."),
    checkpoint_cost: float = typer.Option(0.0, "--checkpoint-cost", min=0.0, help="Seconds each checkpoint save takes."),
    seed: int = typer.Option(0, "--seed", help="Random seed (spot evictions)."),
    catalog_file: Optional[Path] = typer.Option(None, "--catalog", help="A TOML catalog file (your SKUs / prices)."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as one JSON object."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar (it shows only on a terminal)."),
) -> None:
    """Simulate a job trace on a cluster's node pools: cost, utilization, queueing delay, lost work.

    Gang scheduling, priorities and preemption, the cluster autoscaler, spot evictions with
    checkpoint/restart. Prints cost, GPU utilization, queueing delay (p50/p99), lost work and makespan.

    Examples:

      azulite simulate examples/cluster/cluster.yaml examples/cluster/trace.csv --plot sim.png

      azulite simulate cluster.yaml cluster_job_log --format philly --json
    """
    from azulite.catalog import load_catalog
    from azulite.cluster.pools import resolve_pools
    from azulite.cluster.report import check_plot_path, plot, summary_table
    from azulite.cluster.sim import Settings, simulate
    from azulite.cluster.trace import FORMATS, read_trace
    from azulite.spec.cluster import load_cluster

    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}", fix=f"use one of: {', '.join(FORMATS)}")
    if plot_path is not None:
        check_output_file(plot_path, "--plot", "sim.png")  # before the run, not after it
        check_plot_path(plot_path)
    spec = load_cluster(cluster)
    cat = load_catalog(str(catalog_file) if catalog_file else None)
    pools = resolve_pools(spec, catalog=cat, spec_file=cluster)
    for sku in sorted({p.sku for p in pools}):
        if retired := cat.get(sku).retirement():
            err_console().print(f"warning: {retired}", markup=False)
    jobs = read_trace(trace, fmt, job_table=job_table)
    a = spec.autoscaler
    settings = Settings(autoscale=a.enabled, scale_up_delay=a.scale_up_delay, scale_down_unneeded_time=a.scale_down_unneeded_time,
                        scale_down_delay_after_add=a.scale_down_delay_after_add, restart_overhead=spec.restart_overhead,
                        checkpoint_cost=checkpoint_cost, least_cost=spec.expander == "least-cost", seed=seed)
    err = Console(stderr=True, highlight=False)
    if no_progress or as_json or not err.is_terminal:
        result = simulate(jobs, pools, settings)
    else:
        with Progress(TextColumn("simulating"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,} jobs"),
                      TextColumn("t={task.fields[t]}"), TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task("sim", total=len(jobs), t="0 h")
            result = simulate(jobs, pools, settings,
                              progress=lambda done, total, t: bar.update(task, completed=done, t=f"{t / 3600:.1f} h"))
    if plot_path is not None:
        plot(result, plot_path, title=f"{spec.name}: {Path(trace).name}")
    if as_json:
        print(json.dumps(result.summary() | {"skipped": jobs.skipped, "trace": jobs.source,
                                             "prices": {p.name: p.price_label for p in pools}}, indent=2))
        return
    out = _console()
    out.print(summary_table(result, pools, title=f"{spec.name}: {len(jobs):,} jobs from {jobs.source}"))
    if jobs.skipped:
        out.print("skipped while importing: " + ", ".join(f"{k}: {v}" for k, v in jobs.skipped.items()))
    for p in pools:
        out.print(f"  {p.name}: {p.price_label}" + (f"; spot evictions {p.evictions_per_hour:g}/node-hour" if p.spot else ""))
    if plot_path is not None:
        out.print(f"plot: {plot_path}")


def measured_save_seconds(uri: str) -> tuple[Optional[float], str]:
    """The median ``save_seconds`` of the committed checkpoints under ``uri`` (written by azulite.train
    when it records it), and where it came from."""
    from azulite.train.catalog import read_manifest, scan_steps
    from azulite.train.storage import CheckpointStorage, StorageSettings

    storage = CheckpointStorage(uri, StorageSettings.from_environ(os.environ))
    values = []
    for step, rel in scan_steps(storage):
        m = read_manifest(storage, rel, step)
        if m and isinstance(m.get("save_seconds"), (int, float)) and m["save_seconds"] > 0:
            values.append(float(m["save_seconds"]))
    if not values:
        return None, f"no save_seconds in the manifests under {uri}"
    return statistics.median(values), f"median of {len(values)} measured saves under {uri}"


def plan_cmd(
    spec: Path = typer.Argument(..., help="The job spec (resources.instance_type and instance_count: where --hours was measured)."),
    hours: Optional[str] = typer.Option(None, "--hours", help="Wall time measured on the spec's SKU and nodes."),
    samples_per_second: Optional[float] = typer.Option(None, "--samples-per-second", help="Measured throughput on the spec's SKU and nodes (instead of --hours)."),
    samples: Optional[float] = typer.Option(None, "--samples", help="Dataset size (samples per epoch)."),
    epochs: float = typer.Option(1.0, "--epochs", help="Epochs (with --samples-per-second and --samples)."),
    deadline: Optional[str] = typer.Option(None, "--deadline", help="Finish within (p90): 48, 48h, 1d12h, 2d."),
    budget: Optional[float] = typer.Option(None, "--budget", help="Expected cost at most (USD)."),
    checkpoints: Optional[str] = typer.Option(None, "--checkpoints", help="A checkpoint location: read measured save_seconds from its manifests."),
    save_seconds: Optional[float] = typer.Option(None, "--save-seconds", help="Checkpoint save duration when no manifest has one (default 60)."),
    eviction_rate: Optional[float] = typer.Option(None, "--eviction-rate", min=0.0, help="Spot evictions per node-hour."),
    speedup: Optional[List[str]] = typer.Option(None, "--speedup", help="Weigh another GPU type: A100=2.5 (per GPU vs the spec's)."),
    scaling_efficiency: float = typer.Option(0.9, "--scaling-efficiency", help="Throughput kept per doubling of GPUs (assumption)."),
    runs: int = typer.Option(16, "--runs", help="Simulated runs per spot candidate."),
    catalog_file: Optional[Path] = typer.Option(None, "--catalog", help="A TOML catalog file (your SKUs / prices)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object: objective, pick, alternatives."),
) -> None:
    """Recommend SKU, node count, spot or on-demand and the checkpoint interval for a job.

    With expected cost and completion time and their spread (simulated), and the alternatives weighed.

    Examples:

      azulite plan examples/ddp/job.yaml --hours 50 --deadline 24h

      azulite plan job.yaml --hours 50 --budget 200 --checkpoints ./ckpt --speedup A100=2.5
    """
    from azulite.catalog import Sku, load_catalog
    from azulite.cluster.plan import Job, plan
    from azulite.spec.cluster import DEFAULT_EVICTION_RATE_PER_HOUR

    cat = load_catalog(str(catalog_file) if catalog_file else None)
    inst, n, _ = _job_facts(spec)
    if not inst:
        raise SpecError("the planner needs the SKU the run time was measured on", file=str(spec), field="resources.instance_type",
                        fix="add resources: {instance_type: Standard_NC24rs_v3, instance_count: 2}")
    ref: Sku = cat.get(inst)
    h = _work_hours(hours, samples_per_second, samples, epochs)
    delta, source = None, "default (no measured save duration)"
    if checkpoints:
        if "://" not in checkpoints and not Path(checkpoints).exists():
            # a typo'd local path would otherwise read as "no save_seconds" and quietly plan on the 60 s default
            raise SpecError("checkpoint location not found", file=checkpoints, field="--checkpoints",
                            fix="pass the job's outputs.checkpoints folder (or az://container/dir), or --save-seconds S")
        delta, source = measured_save_seconds(checkpoints)
    if delta is None and save_seconds is not None:
        delta, source = save_seconds, "--save-seconds"
    if delta is None:
        delta = 60.0
        source = (source + "; " if checkpoints else "") + "default 60 s"
    ups: dict[str, float] = {}
    for item in speedup or []:  # the types and factors are checked against the catalog by the planner
        k, _, v = item.partition("=")
        if not k.strip() or _number(v) is None:
            raise SpecError(f"takes TYPE=FACTOR, got {item!r}", field="--speedup", fix="e.g. --speedup A100=2.5")
        if k.strip() in ups:
            raise SpecError(f"gives {k.strip()} twice", field="--speedup", fix="give each GPU type once")
        ups[k.strip()] = _number(v)
    if not 0 < scaling_efficiency <= 1:
        raise SpecError(f"must be in (0, 1], got {scaling_efficiency:g}", field="--scaling-efficiency", fix="e.g. --scaling-efficiency 0.9")
    if runs < 1:
        raise SpecError(f"must be >= 1, got {runs}", field="--runs", fix="e.g. --runs 16")
    job = Job(hours=h, ref_sku=ref, ref_nodes=n, save_seconds=delta, save_source=source)
    rate = DEFAULT_EVICTION_RATE_PER_HOUR if eviction_rate is None else eviction_rate
    result = plan(job, deadline_h=_hours(deadline, "--deadline"), budget_usd=budget, catalog=cat, eviction_rate=rate,
                  runs=runs, speedup=ups, scaling_efficiency=scaling_efficiency)
    if as_json:
        from dataclasses import asdict

        print(json.dumps(_finite({"objective": result.objective, "pick": asdict(result.pick) if result.pick else None,
                                  "no_pick": result.no_pick or None,
                                  "simulated": result.simulated, "assumptions": result.assumptions,
                                  "alternatives": [asdict(c) for c in result.candidates]}), indent=2))
        if result.pick is None:
            raise typer.Exit(1)
        return
    out = _console()
    p = result.pick
    if p is None:  # why: none could be weighed, or the fastest / cheapest and its figure against the constraint
        out.print(f"[bold red]no pick[/]: {escape(result.no_pick)}")
    else:
        ck = f"checkpoint every {p.checkpoint_interval_s / 60:.0f} min (Young/Daly)" if p.checkpoint_interval_s else "no evictions modelled: checkpoint as your failure rate needs"
        out.print(f"[bold]pick: {p.label}[/] — expected ${p.cost_mean:,.2f} (p10 ${p.cost_p10:,.2f}, p90 ${p.cost_p90:,.2f}), "
                  f"{p.hours_mean:.1f} h (p90 {p.hours_p90:.1f} h); {ck}")
    n = result.simulated
    out.print(f"objective: {result.objective}; {n} candidate{'' if n == 1 else 's'} simulated")  # was "1 candidates"
    for a in result.assumptions:
        out.print(f"  assumes: {a}")
    table = Table(title="Alternatives weighed", title_justify="left")
    for col in ("candidate", "$/node-h", "bound $", "expected $", "p90 $", "hours", "p90 h", "evictions", "note"):
        table.add_column(col, justify="left" if col in ("candidate", "note") else "right")
    for c in sorted(result.candidates, key=lambda c: (c.cost_mean if c.cost_mean is not None else math.inf, c.bound_usd)):
        f = lambda v, fmt: "-" if v is None or (isinstance(v, float) and math.isinf(v)) else format(v, fmt)  # noqa: E731
        mark = " ✓" if c is p else ""
        table.add_row(c.label + mark, f(c.usd_per_node_hour, ".3f"), f(c.bound_usd, ",.0f"), f(c.cost_mean, ",.2f"),
                      f(c.cost_p90, ",.2f"), f(c.hours_mean, ".1f"), f(c.hours_p90, ".1f"), f(c.evictions_mean, ".2f"),
                      c.note or ("" if c.feasible is not False else "misses a constraint"))
    out.print(table)
    if p is None:
        raise typer.Exit(1)


def _finite(v: object) -> object:
    """JSON has no Infinity: an unbounded figure (unknown price) is null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def register(app: typer.Typer) -> None:
    app.command("cost")(cost)
    app.command("simulate")(simulate_cmd)
    app.command("plan")(plan_cmd)
