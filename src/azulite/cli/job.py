"""``azulite job ...``: validate, submit, list, show, logs, cancel, preempt.

Thin: every command reads settings once, asks the backend from the registry, and renders its typed
records (rich tables for people, ``--json`` for scripts). Errors are AzuliteErrors; ``azulite.cli.main``
turns them into a message and exit code 2 (a user's mistake) or 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from azulite.cli import console
from azulite.contract import CHECKPOINT_OUTPUT
from azulite.errors import AzuliteError
from azulite.launch.backend import Backend, get_backend
from azulite.launch.records import JobRecord, JobState
from azulite.launch.settings import Settings

app = typer.Typer(
    no_args_is_help=True,
    help=(
        "Submit, watch and cancel training jobs (Azure ML command-job YAML, run here as real torchrun agents).\n\n"
        "Examples:\n\n"
        "  azulite job validate examples/ddp/job.yaml\n\n"
        "  azulite job submit examples/ddp/job.yaml --wait\n\n"
        "  azulite job submit examples/ddp/job.yaml --set inputs.steps=100 --set resources.instance_count=1\n\n"
        "  azulite job logs ddp-1 --rank 0 --follow\n\n"
        "  azulite job show ddp-1 --json | jq .state\n\n"
        "  azulite job cancel ddp-1"
    ),
)

_STYLE = {
    "queued": "cyan", "running": "bold blue", "succeeded": "bold green", "failed": "bold red",
    "canceled": "yellow", "preempted": "magenta", "requeued": "magenta",
}
LOG_TAIL_LINES = 20


_out = console.out


def _settings() -> Settings:
    settings = Settings.from_environ()
    if settings.home.exists() and not settings.home.is_dir():  # else a FileExistsError traceback from mkdir
        raise AzuliteError("the azulite home is a file, not a folder", where=str(settings.home),
                           fix="point AZULITE_HOME at a folder (or unset it for ~/.azulite)")
    try:  # the store makes it too: a place it cannot be made is said here, not as mkdir's traceback
        settings.home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AzuliteError(f"cannot create the azulite home: {exc.strerror}", where=str(settings.home),
                           fix="point AZULITE_HOME at a folder you may write (or unset it for ~/.azulite)") from None
    return settings


def _backend(name: Optional[str] = None, environ: Optional[dict] = None) -> Backend:
    settings = _settings()
    if name is None:
        return get_backend(settings.backend, settings, environ)
    return get_backend(name, settings, environ, where=f"--backend {name}")  # what the user typed


def _backend_for(job_id: str) -> Backend:
    """The backend the job store says the job runs on (a kubernetes job is read from its cluster)."""
    from azulite.launch.local.store import JobStore

    settings = _settings()
    try:
        name = JobStore(settings.db_path).get(job_id).backend
    except AzuliteError:
        name = settings.backend
    return get_backend(name, settings)


def _state(s: JobState | str) -> str:
    v = s.value if isinstance(s, JobState) else s
    return f"[{_STYLE.get(v, 'white')}]{v}[/]"


def _ts(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _dur(rec: JobRecord) -> str:
    if not rec.started_at:
        return "-"
    return f"{(rec.ended_at or time.time()) - rec.started_at:.1f}s"


def outcome_exit_code(rec: JobRecord) -> int:
    """What ``submit --wait`` exits with: 0 succeeded; a failed job's exit code (1 if unknown); 130 canceled."""
    if rec.state == JobState.SUCCEEDED:
        return 0
    if rec.state == JobState.CANCELED:
        return 130
    code = rec.exit_code or 1
    return code if 0 < code < 256 else 1


def last_log_line(path: str | None, chunk: int = 8192) -> str | None:
    """The last non-empty line of a log, reading only its end (logs grow to gigabytes)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chunk))
            tail = f.read()
    except OSError:
        return None
    lines = [line for line in tail.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else None


def progress_of(rec: JobRecord) -> str | None:
    """What ``--wait`` shows as a running job's progress: rank 0's last log line. The one place to switch
    to recorded training metrics (step, loss, samples/s) once jobs record them."""
    for p in rec.processes:
        if p.kind == "rank" and p.rank == 0 and p.attempt == rec.attempt:
            return last_log_line(p.log)
    return None


def log_tail(path: str | None, n: int = LOG_TAIL_LINES) -> list[str]:
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            return [l.decode("utf-8", "replace").rstrip("\n") for l in deque(f, maxlen=n)]
    except OSError:
        return []


def failed_rank_log(rec: JobRecord) -> tuple[int | None, str | None]:
    if rec.failed_rank is None:
        return None, None
    for p in rec.processes:
        if p.kind == "rank" and p.rank == rec.failed_rank and p.attempt == rec.attempt:
            return p.rank, p.log
    return rec.failed_rank, None


def checkpoints_of(rec: JobRecord) -> tuple[list[dict], str | None]:
    """The committed and partial checkpoints under the job's ``outputs.checkpoints`` (oldest first), read
    from storage with the job's own environment (its Azure credentials); and why they could not be read."""
    raw = (rec.spec.get("outputs") or {}).get(CHECKPOINT_OUTPUT)
    if raw is None:
        return [], None
    from azulite.spec.job import Output
    from azulite.train.catalog import list_checkpoints  # torch-free; adlfs only for az:// locations

    try:
        location = Output.model_validate(raw).location(rec.job_dir, CHECKPOINT_OUTPUT)
        infos = list_checkpoints(location, environ={**os.environ, **rec.spec.get("environment_variables", {})})
    except AzuliteError as e:
        return [], str(e)
    return [asdict(i) for i in infos], None


def metrics_of(rec: JobRecord) -> tuple[dict[str, dict], str | None]:
    """The last value of every metric the job logged to its MLflow store; and why it could not be read."""
    from azulite.launch.tracking import last_metrics  # imports mlflow only when the job has a store
    from azulite.spec.job import JobSpec

    if rec.spec.get("type") == "sweep":
        return {}, None  # a sweep logs nothing itself: its trials do (see its trials table)
    try:
        return last_metrics(JobSpec.model_validate(rec.spec), rec.job_dir, job_id=rec.id), None
    except AzuliteError as e:
        return {}, str(e)
    except ValueError as e:  # an old record whose spec no longer validates
        return {}, f"spec does not validate: {str(e).splitlines()[0]}"


@app.command()
def validate(
    file: Path = typer.Argument(..., help="Job spec (YAML)."),
    set_: List[str] = typer.Option([], "--set", help="Override a field: --set path=value (repeatable)."),
    json_: bool = typer.Option(False, "--json", help="Print the validated spec as JSON."),
) -> None:
    """Check a job spec without running it; exits 2 with file:line, field, value and fix if it is wrong.

    Example: azulite job validate examples/ddp/job.yaml --set distribution.process_count_per_instance=1
    """
    from azulite.spec.sweep import SweepSpec, load_spec

    spec = load_spec(file, set_)
    if json_:
        print(json.dumps(spec.model_dump(mode="json"), indent=2))
        return
    if isinstance(spec, SweepSpec):
        _out().print(f"[green]ok[/] {file}: sweep {spec.name}, {spec.sampling_algorithm.type} over "
                     f"{', '.join(spec.search_space)}, up to {spec.limits.max_total_trials} trial(s), "
                     f"{spec.objective.goal} {spec.objective.primary_metric}")
        return
    _out().print(f"[green]ok[/] {file}: {spec.name}, {spec.distribution_type} {_shape(spec)}", highlight=False)


def _shape(spec) -> str:
    """How the ranks are laid out, as the launcher will: TF workers and parameter servers, an elastic range."""
    from azulite.spec.job import TensorFlowDistribution

    d = spec.distribution
    if isinstance(d, TensorFlowDistribution):
        ps = f" + {d.parameter_server_count} parameter server(s)" if d.parameter_server_count else ""
        return f"{d.worker_count} worker(s){ps} on {spec.nodes} node(s)"
    low, high = spec.node_range
    nodes = f"{low}-{high} node(s) (elastic)" if low != high else f"{spec.nodes} node(s)"
    ranks = f"{low * spec.processes_per_node}-{spec.world_size}" if low != high else f"{spec.world_size}"
    return f"{nodes} x {spec.processes_per_node} process(es) = {ranks} rank(s)"


@app.command()
def submit(
    file: Path = typer.Argument(..., help="Job spec (YAML, Azure ML command-job shape)."),
    set_: List[str] = typer.Option([], "--set", help="Override a field: --set path=value (repeatable)."),
    wait: bool = typer.Option(False, "--wait", "-w", help="Block until the job ends; exit 0 only if it succeeded."),
    json_: bool = typer.Option(False, "--json", help="Print the job record as JSON."),
    backend: Optional[str] = typer.Option(None, "--backend", help="Launch backend (default: AZULITE_BACKEND or local)."),
    flavor: Optional[str] = typer.Option(None, "--flavor", help="kubernetes backend: indexed-job, pytorchjob, tfjob or mpijob (AZULITE_K8S_FLAVOR)."),
) -> None:
    """Submit a job. It runs detached (it outlives this shell); --wait follows it to the end.

    Examples:

      azulite job submit examples/ddp/job.yaml --wait

      azulite job submit examples/ddp/job.yaml --set inputs.steps=200 --set max_restarts=2
    """
    from azulite.spec.sweep import SweepSpec, load_spec

    spec = load_spec(file, set_)
    if flavor is not None:  # said here as the flag typed, not as the setting it is passed on as
        from azulite.deploy.options import FLAVORS

        if flavor not in FLAVORS:
            raise AzuliteError(f"{flavor!r} is not a flavor", where="--flavor", fix=f"use one of: {', '.join(FLAVORS)}")
        if (backend or _settings().backend) != "kubernetes":  # it would be dropped without a word
            raise AzuliteError("--flavor chooses the Kubernetes objects of --backend kubernetes", where="--flavor",
                               fix="add --backend kubernetes, or drop --flavor")
    b = _backend(backend, {**os.environ, "AZULITE_K8S_FLAVOR": flavor} if flavor else None)
    if isinstance(spec, SweepSpec):
        if not hasattr(b, "submit_sweep"):
            raise AzuliteError(f"the {b.name} backend cannot run sweep jobs", fix="use the local backend")
        rec = b.submit_sweep(spec, spec_path=str(file))
    else:
        rec = b.submit(spec, spec_path=str(file))
    if not wait:
        if json_:
            print(json.dumps(rec.to_json()))
        else:
            what = "sweep" if isinstance(spec, SweepSpec) else f"{spec.world_size} ranks"
            _out().print(f"submitted [bold]{rec.id}[/] ({what})  ->  azulite job logs {rec.id} --follow")
        return
    rec = _wait(b, rec, quiet=json_)
    if json_:
        print(json.dumps(rec.to_json()))
    else:
        _print_show(rec)
    raise typer.Exit(outcome_exit_code(rec))


WAIT_LOOK_S = 1.0  # a waiter's look at the job (state, progress); the job's end wakes a local waiter at once
PROGRESS_EVERY_S = 10.0  # not a terminal (a CI log): a progress line at most this often, when it changed


@contextlib.contextmanager
def _still_running_on_interrupt(job_id: str):
    """Ctrl-C while waiting stops the waiting, not the job: say so (exit 130, as for any SIGINT)."""
    try:
        yield
    except KeyboardInterrupt:
        console.err().print(f"stopped waiting; {job_id} goes on (azulite job cancel {job_id} stops it, "
                            f"azulite job wait {job_id} follows it again)", markup=False)
        raise typer.Exit(130) from None


def _wait(b: Backend, rec: JobRecord, *, quiet: bool) -> JobRecord:
    err = console.err()
    last = None
    shown, shown_at = None, float("-inf")
    with err.status(f"{rec.id}: {rec.state.value}", spinner="dots") as status, _still_running_on_interrupt(rec.id):
        while True:
            rec = b.status(rec.id)
            key = (rec.state, rec.attempt)
            if key != last and not quiet:
                err.print(f"{_ts(time.time())}  {rec.id}  {_state(rec.state)}"
                          + (f"  (attempt {rec.attempt})" if rec.attempt else ""))
                last = key
            progress = progress_of(rec) if rec.state == JobState.RUNNING else None
            status.update(f"{rec.id}: {rec.state.value}  {_dur(rec)}" + (f"  rank 0: {escape(progress)}" if progress else ""))
            if (progress and progress != shown and not quiet and not err.is_terminal
                    and time.monotonic() - shown_at >= PROGRESS_EVERY_S):
                err.print(f"{_ts(time.time())}  {rec.id}  rank 0: {progress}", markup=False)
                shown, shown_at = progress, time.monotonic()
            if rec.state.terminal:
                return rec
            b.wait_for_change(rec, WAIT_LOOK_S)


@app.command("wait")
def wait_(
    job_id: str = typer.Argument(..., help="Job id."),
    checkpoint: bool = typer.Option(False, "--checkpoint", help="Return once the job has a committed checkpoint."),
    timeout: float = typer.Option(0, "--timeout", min=0, help="Give up after this many seconds (exit 124); 0: never."),
    json_: bool = typer.Option(False, "--json", help="Print the job record as JSON."),
) -> None:
    """Block until the job ends (exit code as `submit --wait`), or with --checkpoint until it has committed
    a checkpoint (exit 0; 1 if it ended without one).

    Examples:

      azulite job wait ddp-1

      azulite job wait ddp-1 --checkpoint --timeout 120 && azulite job preempt ddp-1
    """
    b = _backend_for(job_id)
    if checkpoint:
        rec = b.status(job_id)
        if CHECKPOINT_OUTPUT not in (rec.spec.get("outputs") or {}):
            raise AzuliteError(f"job {job_id} has no outputs.{CHECKPOINT_OUTPUT}: it can never have a committed checkpoint",
                               where="--checkpoint",
                               fix=f"declare outputs.{CHECKPOINT_OUTPUT} in the spec, or wait without --checkpoint")
    deadline = time.monotonic() + timeout if timeout > 0 else None
    with _still_running_on_interrupt(job_id):
        _wait_for(b, job_id, checkpoint, json_, deadline, timeout)


def _wait_for(b: Backend, job_id: str, checkpoint: bool, json_: bool, deadline: float | None, timeout: float) -> None:
    while True:
        rec = b.status(job_id)
        if checkpoint and any(c["committed"] for c in checkpoints_of(rec)[0]):
            if json_:
                print(json.dumps(rec.to_json()))
            return
        if rec.state.terminal:
            if json_:
                print(json.dumps(rec.to_json()))
            elif not checkpoint:
                _print_show(rec)
            else:
                console.err().print(f"{job_id} ended ({rec.state.value}) without a committed checkpoint", markup=False)
            raise typer.Exit(1 if checkpoint else outcome_exit_code(rec))
        if deadline is not None and time.monotonic() > deadline:
            what = f"a committed checkpoint of {job_id}" if checkpoint else f"{job_id} to end"
            console.err().print(f"[yellow]timed out[/] after {timeout:g} s waiting for {what} "
                                f"(state {rec.state.value})")
            raise typer.Exit(124)
        b.wait_for_change(rec, WAIT_LOOK_S)


@app.command("list")
def list_(
    limit: int = typer.Option(20, "--limit", "-n", min=1, help="How many recent jobs (at least 1)."),
    json_: bool = typer.Option(False, "--json", help="JSON lines, one job per line."),
) -> None:
    """List recent jobs, newest first.  Example: azulite job list -n 5"""
    recs = _backend().list(limit)
    if json_:
        for r in recs:
            d = r.to_json()
            # the list reads the jobs table alone: empty processes/attempts/events here are not data
            for key in ("spec", "processes", "attempts", "events"):
                d.pop(key, None)
            print(json.dumps(d))
        return
    t = Table(box=None)
    for col in ("id", "state", "attempt", "ranks", "created", "duration", "exit"):
        width = {"id": max([len(r.id) for r in recs] + [2]), "state": 9}.get(col, len(col))
        t.add_column(col, no_wrap=True, min_width=width)
    out = _out()
    whole = out.width >= console.UNBOUNDED  # not a terminal: a CI log or a pipe gets the reason whole
    t.add_column("reason", overflow="ellipsis", no_wrap=True, max_width=None if whole else 40)
    for r in recs:
        world = _world(r)
        t.add_row(r.id, _state(r.state), str(r.attempt), str(world), _ts(r.created_at)[5:16], _dur(r),
                  "-" if r.exit_code is None else str(r.exit_code), (r.reason or "") if whole else (r.reason or "")[:60])
    out.print(t)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> '0-3'; [0, 2] -> '0, 2'."""
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _world(r: JobRecord) -> int:
    from azulite.spec.job import JobSpec

    try:
        return JobSpec.model_validate(r.spec).world_size
    except Exception:  # an old record whose spec no longer validates: still listable
        return 0


@app.command()
def show(
    job_id: str = typer.Argument(..., help="Job id, e.g. ddp-1."),
    json_: bool = typer.Option(False, "--json", help="Machine-readable record."),
) -> None:
    """State, attempts, exit codes, processes (node/rank/pid), log paths; a failed rank's log tail.

    Example: azulite job show ddp-1 --json
    """
    rec = _backend_for(job_id).status(job_id)
    if json_:
        d = rec.to_json()
        rank, path = failed_rank_log(rec)
        d["failed_rank_log_tail"] = log_tail(path) if path else []
        d["checkpoints"], d["checkpoints_error"] = checkpoints_of(rec)
        d["metrics"], d["metrics_error"] = metrics_of(rec)
        if rec.spec.get("type") == "sweep":
            d["sweep"] = _sweep_state(rec.job_dir)
        print(json.dumps(d, indent=2))
        return
    _print_show(rec)


def _sweep_state(job_dir: str) -> dict | None:
    from azulite.launch.local.sweeper import read_state  # the sweep driver (numpy's samplers) only for a sweep

    return read_state(job_dir)


def _rel(path: str | None, root: str) -> str:
    if not path:
        return ""
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return path


def _print_show(rec: JobRecord) -> None:
    c = _out()
    c.print(f"[bold]{rec.id}[/]  {_state(rec.state)}  attempt {rec.attempt}  backend {rec.backend}")
    c.print(f"  created {_ts(rec.created_at)}  started {_ts(rec.started_at)}  ended {_ts(rec.ended_at)}  "
            f"duration {_dur(rec)}")
    if rec.exit_code is not None or rec.reason:
        c.print(f"  exit code {rec.exit_code if rec.exit_code is not None else '-'}  {rec.reason or ''}")
    c.print(f"  spec {rec.spec_path or '-'}  environment {rec.environment or '-'}  dir {rec.job_dir}")
    if len(rec.attempts) > 1 or any(a.state != rec.state.value for a in rec.attempts):
        t = Table("attempt", "state", "started", "ended", "exit", "reason", box=None, title="attempts")
        for a in rec.attempts:
            t.add_row(str(a.attempt), _state(a.state), _ts(a.started_at), _ts(a.ended_at),
                      "-" if a.exit_code is None else str(a.exit_code), a.reason or "")
        c.print(t)
    procs = [p for p in rec.processes if p.attempt == rec.attempt]
    if procs:
        t = Table("process", "node", "rank", "local", "pid", "exit", "log (under the job dir)", box=None,
                  title=f"processes (attempt {rec.attempt})")
        for p in sorted(procs, key=lambda p: (p.kind != "agent", p.node, p.rank if p.rank is not None else -1)):
            t.add_row(p.name, str(p.node), "-" if p.rank is None else str(p.rank),
                      "-" if p.local_rank is None else str(p.local_rank), str(p.pid or "-"),
                      "-" if p.exit_code is None else str(p.exit_code), _rel(p.log, rec.job_dir))
        c.print(t)
    cks, error = checkpoints_of(rec)
    if cks:
        t = Table("step", "committed", "bytes", "uri", box=None, title="checkpoints")
        for ck in cks:
            t.add_row(str(ck["step"]), "yes" if ck["committed"] else "[yellow]partial[/]", str(ck["bytes"]), ck["uri"])
        c.print(t)
    if error:
        c.print(f"[yellow]checkpoints could not be listed:[/] {error}", markup=True)
    sweep = _sweep_state(rec.job_dir) if rec.spec.get("type") == "sweep" else None
    if sweep:
        t = Table("trial", "state", sweep["primary_metric"], "values", box=None,
                  title=f"trials ({sweep['goal']} {sweep['primary_metric']}; best: {sweep['best_trial'] or '-'})")
        for tr in sweep["trials"]:
            mark = " [green]best[/]" if tr["id"] == sweep["best_trial"] else ""
            t.add_row(tr["id"] + mark, tr["state"], "-" if tr["metric"] is None else f"{tr['metric']:.6g}",
                      json.dumps(tr["values"]))
        c.print(t)
    metrics, error = metrics_of(rec)
    if metrics:
        t = Table("metric", "last value", "step", box=None, title="metrics (MLflow)")
        for name, m in sorted(metrics.items()):
            t.add_row(name, f"{m['value']:.6g}", str(m["step"]))
        c.print(t)
    if error:
        c.print(f"[yellow]metrics could not be read:[/] {error}", markup=True)
    rank, path = failed_rank_log(rec)
    if rec.state == JobState.FAILED and path:
        c.print(f"[red]last {LOG_TAIL_LINES} lines of rank {rank}[/] ({path}):")
        for line in log_tail(path):
            c.print(f"  {line}", markup=False)


@app.command()
def logs(
    job_id: str = typer.Argument(..., help="Job id."),
    rank: Optional[int] = typer.Option(None, "--rank", "-r", help="Only this rank (default: all, prefixed)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
) -> None:
    """Print the latest attempt's rank logs.  Example: azulite job logs ddp-1 --rank 0 --follow"""
    b = _backend_for(job_id)
    if rank is not None:
        rec = b.status(job_id)
        ranks = sorted({p.rank for p in rec.processes if p.rank is not None} | set(range(_world(rec))))
        if rank not in ranks:
            raise AzuliteError(f"job {job_id} has no rank {rank}", where="--rank",
                               fix=f"its ranks are {_ranges(ranks)}" if ranks else "its ranks are not known yet")
    for line in b.logs(job_id, rank=rank, follow=follow):
        print(line, flush=follow)


@app.command()
def cancel(
    job_id: str = typer.Argument(..., help="Job id."),
    json_: bool = typer.Option(False, "--json", help="Print {id, state, already_ended} as JSON."),
) -> None:
    """End every process of the job (SIGTERM, then SIGKILL after a grace period) and mark it canceled.

    Example: azulite job cancel ddp-1
    """
    b = _backend_for(job_id)
    before = b.status(job_id)
    rec = before if before.state.terminal else b.cancel(job_id)
    if json_:
        print(json.dumps({"id": rec.id, "state": rec.state.value, "already_ended": before.state.terminal}))
    elif before.state.terminal:
        _out().print(f"{rec.id} had already ended ({_state(rec.state)}): nothing to cancel")
    else:
        _out().print(f"{rec.id}: {_state(rec.state)}")


@app.command()
def preempt(
    job_id: str = typer.Argument(..., help="Job id of a running job."),
    json_: bool = typer.Option(False, "--json", help="Print {id, state, preempt_requested} as JSON."),
) -> None:
    """Simulate a spot eviction: one SIGTERM to every process of every rank; ranks that commit a checkpoint
    and exit 75 get the job requeued as a new attempt (AZULITE_ATTEMPT=n+1).  Example: azulite job preempt ddp-1"""
    rec = _backend_for(job_id).preempt(job_id)
    if json_:
        print(json.dumps({"id": rec.id, "state": rec.state.value, "preempt_requested": True}))
    else:
        _out().print(f"{rec.id}: preemption requested (state {_state(rec.state)})")
