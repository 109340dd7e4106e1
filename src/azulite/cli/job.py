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
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from azulite.cli import console
from azulite.cli.job_view import (checkpoints_of, duration, failed_rank_log, log_tail, metrics_of, outcome_exit_code,
                                  parameter_servers_of, print_show, progress_of, rank_ranges, styled_state,
                                  sweep_state, timestamp, world_size_of)
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
    for line in environment_notes(spec.trial_spec() if isinstance(spec, SweepSpec) else spec, b.name,
                                  "trial." if isinstance(spec, SweepSpec) else ""):
        console.err().print(line, markup=False)
    if isinstance(spec, SweepSpec):
        if not hasattr(b, "submit_sweep"):
            raise AzuliteError(f"the {b.name} backend cannot run sweep jobs",
                               fix="use the local backend" + (f"; for Azure ML, render it as a sweep job (azulite "
                                   f"deploy render {file} --target azureml --out DIR) and create that with az ml job "
                                   "create -f" if b.name == "azureml" else ""))
        rec = b.submit_sweep(spec, spec_path=str(file))
    else:
        rec = b.submit(spec, spec_path=str(file))
    if not wait:
        if json_:
            print(json.dumps(rec.to_json()))
        else:
            if isinstance(spec, SweepSpec):  # a sweep has no log of its own: its trials do
                _out().print(f"submitted [bold]{rec.id}[/] (sweep)  ->  azulite job show {rec.id} (its trials, best so "
                             f"far), azulite job wait {rec.id}")
            else:
                _out().print(f"submitted [bold]{rec.id}[/] ({spec.world_size} ranks)  ->  azulite job logs {rec.id} --follow")
        return
    rec = _wait(b, rec, quiet=json_)
    if json_:
        print(json.dumps(rec.to_json()))
    else:
        print_show(rec)
    raise typer.Exit(outcome_exit_code(rec))


def environment_notes(spec, backend: str, prefix: str = "") -> list[str]:  # type: ignore[no-untyped-def]
    """Lines for stderr at submit: the spec's environment_variables its launcher replaces (RANK, WORLD_SIZE,
    MASTER_ADDR, TF_CONFIG...: they never reach a process), and what a pytorch job's MASTER_PORT does here."""
    from azulite.launch.env import overridden_variables

    env, kind = spec.environment_variables, spec.distribution_type
    lines = []
    lost = overridden_variables(list(env), kind, list(spec.inputs), list(spec.outputs))
    if lost:
        who = "a job without distribution" if kind == "none" else f"a {kind} job"
        lines.append(f"warning: {prefix}environment_variables: {', '.join(lost)} {'is' if len(lost) == 1 else 'are'} "
                     f"set for every process of {who} by its launcher and azulite, so the spec's "
                     f"{'value is' if len(lost) == 1 else 'values are'} replaced; remove "
                     f"{'it' if len(lost) == 1 else 'them'} from the spec")
    if kind == "pytorch" and "MASTER_PORT" in env and backend == "local":
        lines.append(f"note: {prefix}environment_variables.MASTER_PORT={env['MASTER_PORT']} pins torchrun's c10d "
                     f"rendezvous (--rdzv-endpoint 127.0.0.1:{env['MASTER_PORT']}); each process's MASTER_PORT is "
                     "the port of torchrun's own store, which torch.distributed's init_process_group uses")
    return lines


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
                err.print(f"{timestamp(time.time())}  {rec.id}  {styled_state(rec.state)}"
                          + (f"  (attempt {rec.attempt})" if rec.attempt else ""))
                last = key
            progress = progress_of(rec) if rec.state == JobState.RUNNING else None
            status.update(f"{rec.id}: {rec.state.value}  {duration(rec)}" + (f"  rank 0: {escape(progress)}" if progress else ""))
            if (progress and progress != shown and not quiet and not err.is_terminal
                    and time.monotonic() - shown_at >= PROGRESS_EVERY_S):
                err.print(f"{timestamp(time.time())}  {rec.id}  rank 0: {progress}", markup=False)
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
        # one this job committed (a checkpoint of another job at its location is not this job's progress)
        if checkpoint and any(c["committed"] and c.get("job_id") in (None, job_id) for c in checkpoints_of(rec)[0]):
            if json_:
                print(json.dumps(rec.to_json()))
            return
        if rec.state.terminal:
            if json_:
                print(json.dumps(rec.to_json()))
            elif not checkpoint:
                print_show(rec)
            else:
                console.err().print(f"{job_id} ended ({rec.state.value}) without a committed checkpoint", markup=False)
            raise typer.Exit(1 if checkpoint else outcome_exit_code(rec))
        if deadline is not None and time.monotonic() > deadline:
            if json_:  # a script reads the record as it stands (it got nothing on stdout)
                print(json.dumps(rec.to_json()))
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
        world = world_size_of(r)
        t.add_row(r.id, styled_state(r.state), str(r.attempt), str(world), timestamp(r.created_at)[5:16], duration(r),
                  "-" if r.exit_code is None else str(r.exit_code), (r.reason or "") if whole else (r.reason or "")[:60])
    out.print(t)


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
            d["sweep"] = sweep_state(rec.job_dir)
        print(json.dumps(d, indent=2))
        return
    print_show(rec)


@app.command()
def logs(
    job_id: str = typer.Argument(..., help="Job id."),
    rank: Optional[int] = typer.Option(None, "--rank", "-r", help="Only this rank (default: all, prefixed)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
) -> None:
    """Print the latest attempt's rank logs.  Example: azulite job logs ddp-1 --rank 0 --follow"""
    b = _backend_for(job_id)
    rec = b.status(job_id)
    if rec.spec.get("type") == "sweep":  # it printed nothing: the logs are the trials'
        trials = [t["id"] for t in ((sweep_state(rec.job_dir) or {}).get("trials") or [])]
        raise AzuliteError(f"{job_id} is a sweep: its trials have the logs" + (f" ({', '.join(trials)})" if trials else
                           " (none started yet)"), where=job_id,
                           fix=f"azulite job logs {trials[0] if trials else 'TRIAL'}; azulite job show {job_id} lists them")
    if rank is not None:
        world = world_size_of(rec)
        ranks = sorted({p.rank for p in rec.processes if p.rank is not None} | set(range(world)))
        ps = parameter_servers_of(rec)  # past the workers: a TensorFlow job's parameter servers (as on kubernetes)
        if rank not in ranks and not (ps and world <= rank < world + ps):
            servers = (f" (workers) and {rank_ranges(list(range(world, world + ps)))} (parameter servers)"
                       if ps else "")
            raise AzuliteError(f"job {job_id} has no rank {rank}", where="--rank",
                               fix=f"its ranks are {rank_ranges(ranks)}{servers}" if ranks else "its ranks are not known yet")
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
    if before.state.terminal:
        rec = before
    else:  # a process that ignores SIGTERM holds this for the grace period: say what is happening meanwhile
        with console.err().status(f"{job_id}: stopping its processes (SIGTERM; SIGKILL after "
                                  f"{_settings().kill_grace_s:g} s for any left)", spinner="dots"):
            rec = b.cancel(job_id)
    if json_:
        print(json.dumps({"id": rec.id, "state": rec.state.value, "already_ended": before.state.terminal}))
    elif before.state.terminal:
        _out().print(f"{rec.id} had already ended ({styled_state(rec.state)}): nothing to cancel")
    else:
        _out().print(f"{rec.id}: {styled_state(rec.state)}")


@app.command()
def preempt(
    job_id: str = typer.Argument(..., help="Job id of a running job."),
    json_: bool = typer.Option(False, "--json", help="Print {id, state, preempt_requested} as JSON."),
) -> None:
    """Simulate a spot eviction: one SIGTERM to every process of every rank; ranks that commit a checkpoint
    and exit 75 get the job requeued as a new attempt (AZULITE_ATTEMPT=n+1).  Example: azulite job preempt ddp-1"""
    b = _backend_for(job_id)
    if b.status(job_id).spec.get("type") == "sweep":  # accepted, and nothing happened to its trials
        raise AzuliteError(f"{job_id} is a sweep: its trials are the jobs that run", where=job_id,
                           fix=f"preempt a trial (azulite job show {job_id} lists them), or cancel the sweep")
    rec = b.preempt(job_id)
    if json_:
        print(json.dumps({"id": rec.id, "state": rec.state.value, "preempt_requested": True}))
    else:
        _out().print(f"{rec.id}: preemption requested (state {styled_state(rec.state)})")
