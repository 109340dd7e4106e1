"""What a job record shows: its state in colour, times, the exit code ``--wait`` gives, rank 0's progress,
a failed rank's log tail, its checkpoints and metrics, and ``job show``'s whole view. Read-only helpers of
``azulite job`` (cli/job.py: the commands) and ``job nodes``."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from azulite.cli import console
from azulite.contract import CHECKPOINT_OUTPUT
from azulite.errors import AzuliteError
from azulite.launch.records import JobRecord, JobState

_out = console.out

_STYLE = {
    "queued": "cyan", "running": "bold blue", "succeeded": "bold green", "failed": "bold red",
    "canceled": "yellow", "preempted": "magenta", "requeued": "magenta",
}
LOG_TAIL_LINES = 20


def styled_state(s: JobState | str) -> str:
    v = s.value if isinstance(s, JobState) else s
    return f"[{_STYLE.get(v, 'white')}]{v}[/]"


def timestamp(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def duration(rec: JobRecord) -> str:
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


_TAIL_BYTES = 64 * 1024  # read from the end of a log (a rank's log may be GBs)
_LINE_CHARS = 1000  # a line is shown up to this long (a 20 MB line without a newline was printed whole)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # escapes and NULs of a rank's output: shown, not obeyed


def log_tail(path: str | None, n: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``n`` lines of a log, read from its last 64 KiB, each cut at 1000 characters and its control
    characters shown escaped (``\\x1b``): a terminal does not run a rank's escape sequences."""
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _TAIL_BYTES))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").split("\n")
    if size > _TAIL_BYTES:
        lines = lines[1:] or [""]  # the first was cut by where the read began
    if lines and lines[-1] == "":
        lines.pop()
    out = []
    for line in lines[-n:]:
        line = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", line.rstrip("\r"))
        out.append(line if len(line) <= _LINE_CHARS else f"{line[:_LINE_CHARS]} ... ({len(line) - _LINE_CHARS} more "
                   "characters)")
    return out


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
        env = {**os.environ, **rec.spec.get("environment_variables", {})}
        env.setdefault("AZULITE_STORAGE_RETRIES", "1")  # a look, not a save: Blob down took `job show` 18 s
        infos = list_checkpoints(location, environ=env)
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


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> '0-3'; [0, 2] -> '0, 2'."""
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def world_size_of(r: JobRecord) -> int:
    from azulite.spec.job import JobSpec

    try:
        return JobSpec.model_validate(r.spec).world_size
    except Exception:  # an old record whose spec no longer validates: still listable
        return 0


def parameter_servers_of(r: JobRecord) -> int:
    """A TensorFlow job's parameter servers (their logs come after the workers': ``job logs --rank N``)."""
    dist = r.spec.get("distribution") or {}
    if str(dist.get("type", "")).lower() != "tensorflow":
        return 0
    try:
        return max(0, int(dist.get("parameter_server_count", 0)))
    except (TypeError, ValueError):
        return 0


def sweep_state(job_dir: str) -> dict | None:
    from azulite.launch.local.sweeper import read_state  # the sweep driver (numpy's samplers) only for a sweep

    return read_state(job_dir)


def _rel(path: str | None, root: str) -> str:
    if not path:
        return ""
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return path


def print_show(rec: JobRecord) -> None:
    c = _out()
    c.print(f"[bold]{rec.id}[/]  {styled_state(rec.state)}  attempt {rec.attempt}  backend {rec.backend}")
    c.print(f"  created {timestamp(rec.created_at)}  started {timestamp(rec.started_at)}  ended {timestamp(rec.ended_at)}  "
            f"duration {duration(rec)}")
    if rec.exit_code is not None or rec.reason:
        c.print(f"  exit code {rec.exit_code if rec.exit_code is not None else '-'}  {rec.reason or ''}")
    c.print(f"  spec {rec.spec_path or '-'}  environment {rec.environment or '-'}  dir {rec.job_dir}")
    if len(rec.attempts) > 1 or any(a.state != rec.state.value for a in rec.attempts):
        t = Table("attempt", "state", "started", "ended", "exit", "reason", box=None, title="attempts")
        for a in rec.attempts:
            t.add_row(str(a.attempt), styled_state(a.state), timestamp(a.started_at), timestamp(a.ended_at),
                      "-" if a.exit_code is None else str(a.exit_code), a.reason or "")
        c.print(t)
    procs = [p for p in rec.processes if p.attempt == rec.attempt]
    if procs:
        # torchrun's restarts inside the attempt (max_restarts), when there were any: shown only in --json before
        restarted = any(p.restarts for p in procs)
        t = Table("process", "node", "rank", "local", "pid", "exit", *(("restarts",) if restarted else ()),
                  "log (under the job dir)", box=None, title=f"processes (attempt {rec.attempt})")
        for p in sorted(procs, key=lambda p: (p.kind != "agent", p.node, p.rank if p.rank is not None else -1)):
            t.add_row(p.name, str(p.node), "-" if p.rank is None else str(p.rank),
                      "-" if p.local_rank is None else str(p.local_rank), str(p.pid or "-"),
                      "-" if p.exit_code is None else str(p.exit_code),
                      *((str(p.restarts) if p.kind == "rank" else "-",) if restarted else ()), _rel(p.log, rec.job_dir))
        c.print(t)
    cks, error = checkpoints_of(rec)
    if cks:
        t = Table("step", "committed", "bytes", "uri", box=None, title="checkpoints")
        for ck in cks:
            t.add_row(str(ck["step"]), "yes" if ck["committed"] else "[yellow]partial[/]", str(ck["bytes"]), ck["uri"])
        c.print(t)
    if error:
        c.print(f"[yellow]checkpoints could not be listed:[/] {error}", markup=True)
    sweep = sweep_state(rec.job_dir) if rec.spec.get("type") == "sweep" else None
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
