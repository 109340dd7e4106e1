"""Job traces for the simulator: azulite's CSV, and importers for the public GPU-cluster traces in their
native formats (Microsoft Philly ``cluster_job_log``, Alibaba PAI 2020 job/task tables, Alibaba 2023
``openb_pod_list_*.csv``).

The CSV (one job per row, header required, ``#`` lines are comments)::

    job_id,submit_time,gpus,duration[,priority,node_selector,tolerations,checkpoint_interval]
    train-1,0,8,7200
    train-2,30,16,36000,10,agentpool=gpunp,kubernetes.azure.com/scalesetpriority=spot:NoSchedule,1800

- ``submit_time``: seconds from the trace's start, non-decreasing (equal times are fine);
- ``gpus``: GPUs the job needs, all at once (gang); ``duration``: seconds of work on those GPUs (> 0);
  both durations also take ``90s``/``30m``/``2h``/``1d``;
- ``priority``: higher preempts lower (default 0); ``node_selector``: ``key=value`` pairs joined by ``;``;
  ``tolerations``: Kubernetes tolerations joined by ``;``: ``key=value:Effect`` (operator Equal), ``key:Effect``
  (Exists), ``key=value`` or ``key`` (every effect); Effect is NoSchedule, PreferNoSchedule or NoExecute;
- ``checkpoint_interval``: seconds of work between checkpoints (empty: none; an evicted job restarts from 0).

A :class:`Trace` holds columns as numpy arrays (the simulator indexes them; a million jobs stay small).
Every problem is a :class:`~azulite.errors.TraceError` naming the file, the line and the column.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from azulite.cluster.pools import TOLERATION_FORMS, check_toleration
from azulite.errors import TraceError
from azulite.spec.cluster import SPOT_TAINT

REQUIRED = ("job_id", "submit_time", "gpus", "duration")
OPTIONAL = ("priority", "node_selector", "tolerations", "checkpoint_interval")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass
class Trace:
    """Jobs sorted by submit time. ``selector`` / ``toleration`` index into ``selectors`` /
    ``tolerations`` (distinct values, so a million jobs share a few tuples)."""

    ids: list[str]
    submit: np.ndarray          # float64 seconds
    gpus: np.ndarray            # int64
    duration: np.ndarray        # float64 seconds of work
    priority: np.ndarray        # int64
    checkpoint_interval: np.ndarray  # float64 seconds of work; inf = never checkpoints
    selector: np.ndarray        # int64 index into selectors
    toleration: np.ndarray      # int64 index into tolerations
    selectors: list[tuple[tuple[str, str], ...]] = field(default_factory=lambda: [()])
    tolerations: list[tuple[str, ...]] = field(default_factory=lambda: [()])
    source: str = ""
    skipped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def from_columns(
        cls, ids: Sequence[str], submit: Iterable[float], gpus: Iterable[int], duration: Iterable[float], *,
        priority: Iterable[int] | None = None, checkpoint_interval: Iterable[float] | None = None,
        source: str = "", skipped: dict[str, int] | None = None, sort: bool = False,
    ) -> "Trace":
        n = len(ids)
        t = cls(
            ids=list(ids), submit=np.asarray(list(submit) if not isinstance(submit, np.ndarray) else submit, dtype=np.float64),
            gpus=np.asarray(list(gpus) if not isinstance(gpus, np.ndarray) else gpus, dtype=np.int64),
            duration=np.asarray(list(duration) if not isinstance(duration, np.ndarray) else duration, dtype=np.float64),
            priority=np.zeros(n, np.int64) if priority is None else np.asarray(list(priority), dtype=np.int64),
            checkpoint_interval=np.full(n, np.inf) if checkpoint_interval is None else np.asarray(list(checkpoint_interval), dtype=np.float64),
            selector=np.zeros(n, np.int64), toleration=np.zeros(n, np.int64), source=source, skipped=dict(skipped or {}),
        )
        if sort:
            t = t.take(np.argsort(t.submit, kind="stable"))
        return t

    def take(self, order: np.ndarray) -> "Trace":
        return Trace(
            ids=[self.ids[i] for i in order], submit=self.submit[order], gpus=self.gpus[order], duration=self.duration[order],
            priority=self.priority[order], checkpoint_interval=self.checkpoint_interval[order], selector=self.selector[order],
            toleration=self.toleration[order], selectors=self.selectors, tolerations=self.tolerations, source=self.source,
            skipped=self.skipped,
        )

    def rebased(self) -> "Trace":
        """Submit times shifted so the first job arrives at 0."""
        if len(self) and self.submit[0] != 0:
            self.submit = self.submit - self.submit[0]
        return self


def _seconds(raw: str, where: str, col: str, *, allow_zero: bool = False) -> float:
    text = raw.strip()
    try:
        v = float(text)
    except ValueError:
        unit = _UNITS.get(text[-1:].lower()) if text else None
        try:
            v = float(text[:-1]) * unit if unit else math.nan
        except ValueError:
            v = math.nan
        if math.isnan(v):
            raise TraceError(f"column {col!r} must be seconds or a duration like 30m, got {raw!r}", where=where,
                             fix=f"write {col} as a number of seconds, e.g. 3600") from None
    if not math.isfinite(v):  # 1e400, inf: "must be >= 0" would not say what is wrong
        raise TraceError(f"column {col!r} must be a finite number of seconds, got {raw!r}", where=where,
                         fix=f"give {col} in seconds, e.g. 3600")
    if v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise TraceError(f"column {col!r} must be {bound}, got {raw!r}", where=where, fix=f"give {col} {bound} seconds")
    return v


def read_csv(path: str | Path) -> Trace:
    """Read azulite's trace CSV (format in the module docstring)."""
    shown = str(path)
    try:
        f = open(path, newline="", encoding="utf-8-sig")
    except (FileNotFoundError, IsADirectoryError):
        raise TraceError("trace not found", where=shown, fix="pass a CSV with columns job_id,submit_time,gpus,duration") from None
    with f:
        line_of: list[int] = []  # the file line of each line the reader is given (comments and blank lines skipped)

        def lines() -> Iterable[str]:
            for n, ln in enumerate(f, start=1):
                if ln.strip() and not ln.lstrip().startswith("#"):
                    line_of.append(n)
                    yield ln

        reader = csv.reader(lines())
        header = next(reader, None)
        if header is None:
            raise TraceError("the trace is empty", where=shown, fix="add a header row: job_id,submit_time,gpus,duration")
        header = [h.strip() for h in header]
        missing = [c for c in REQUIRED if c not in header]
        if missing:
            raise TraceError(f"missing column(s) {', '.join(missing)} (header: {','.join(header)})", where=f"{shown}:{line_of[0]}",
                             fix="the header needs job_id,submit_time,gpus,duration (optional: " + ",".join(OPTIONAL) + ")")
        unknown = [c for c in header if c not in REQUIRED + OPTIONAL]
        if unknown:
            raise TraceError(f"unknown column {unknown[0]!r}", where=f"{shown}:{line_of[0]}", fix="known columns: " + ",".join(REQUIRED + OPTIONAL))
        col = {c: header.index(c) for c in header}
        i_id, i_sub, i_gpu, i_dur = (col[c] for c in REQUIRED)
        i_pri, i_sel, i_tol, i_ckpt = (col.get(c) for c in OPTIONAL)
        ids: list[str] = []
        submit: list[float] = []
        gpus: list[int] = []
        dur: list[float] = []
        pri: list[int] = []
        ckpt: list[float] = []
        sel_idx: list[int] = []
        tol_idx: list[int] = []
        selectors: dict[tuple, int] = {(): 0}
        tolerations: dict[tuple, int] = {(): 0}
        seen: dict[str, int] = {}
        last = -math.inf
        width = len(header)
        for row in reader:
            row_no = line_of[reader.line_num - 1]
            where = f"{shown}:{row_no}"
            if len(row) < 4 or len(row) > width:
                raise TraceError(f"{len(row)} fields, the header has {width}", where=where, fix="one value per header column")
            jid = row[i_id].strip()
            if not jid:
                raise TraceError("empty job_id", where=where, fix="give every job an id")
            if jid in seen:
                raise TraceError(f"duplicate job_id {jid!r} (first at line {seen[jid]})", where=where, fix="job ids must be unique")
            seen[jid] = row_no
            try:
                t = float(row[i_sub])
            except ValueError:
                raise TraceError(f"column 'submit_time' must be seconds, got {row[i_sub]!r}", where=where, fix="write seconds from the trace start") from None
            if not math.isfinite(t):
                raise TraceError(f"column 'submit_time' must be a finite number of seconds, got {row[i_sub]!r}",
                                 where=where, fix="seconds from the trace start")
            if t < 0:
                raise TraceError(f"column 'submit_time' must be >= 0, got {row[i_sub]!r}", where=where, fix="seconds from the trace start")
            if t < last:
                raise TraceError(f"submit_time {t:g} is earlier than the row before ({last:g}): the trace is not sorted",
                                 where=where, fix="sort the rows by submit_time (equal times are fine)")
            last = t
            try:
                g = int(row[i_gpu])
            except ValueError:
                raise TraceError(f"column 'gpus' must be a whole number, got {row[i_gpu]!r}", where=where, fix="e.g. 8") from None
            if g < 1:
                raise TraceError(f"column 'gpus' must be >= 1, got {g}", where=where, fix="a GPU job needs at least 1 GPU")
            ids.append(jid)
            submit.append(t)
            gpus.append(g)
            dur.append(_seconds(row[i_dur], where, "duration"))
            pri.append(_int(row, i_pri, where, "priority"))
            c = row[i_ckpt].strip() if i_ckpt is not None and i_ckpt < len(row) else ""
            ckpt.append(_seconds(c, where, "checkpoint_interval") if c else math.inf)
            s = row[i_sel].strip() if i_sel is not None and i_sel < len(row) else ""
            key = _selector(s, where) if s else ()
            sel_idx.append(selectors.setdefault(key, len(selectors)))
            tl = row[i_tol].strip() if i_tol is not None and i_tol < len(row) else ""
            key2 = _tolerations(tl, where) if tl else ()
            tol_idx.append(tolerations.setdefault(key2, len(tolerations)))
    if not ids:
        raise TraceError("the trace has no jobs", where=shown, fix="add rows below the header")
    trace = Trace.from_columns(ids, submit, gpus, dur, priority=pri, checkpoint_interval=ckpt, source=shown)
    trace.selector = np.asarray(sel_idx, np.int64)
    trace.toleration = np.asarray(tol_idx, np.int64)
    trace.selectors = list(selectors)
    trace.tolerations = list(tolerations)
    return trace


def _int(row: list[str], i: int | None, where: str, name: str) -> int:
    if i is None or i >= len(row) or not row[i].strip():
        return 0
    try:
        return int(row[i])
    except ValueError:
        raise TraceError(f"column {name!r} must be a whole number, got {row[i]!r}", where=where, fix="e.g. 0 or 10") from None


def _selector(text: str, where: str) -> tuple[tuple[str, str], ...]:
    out = []
    for part in text.split(";"):
        k, sep, v = part.strip().partition("=")
        if not sep or not k:
            raise TraceError(f"node_selector {text!r} is not key=value[;key=value]", where=where, fix="e.g. agentpool=gpunp")
        out.append((k, v))
    return tuple(sorted(out))


def _tolerations(text: str, where: str) -> tuple[str, ...]:
    out = []
    for part in (x.strip() for x in text.split(";")):
        if not part:
            continue
        problem = check_toleration(part)
        if problem:
            raise TraceError(f"column 'tolerations': {part!r}: {problem}", where=where,
                             fix=f"a toleration is {TOLERATION_FORMS}; several are joined by ';', e.g. {SPOT_TAINT}")
        out.append(part)
    return tuple(sorted(out))


def write_csv(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as azulite's CSV (what the importers' output looks like on disk)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["job_id", "submit_time", "gpus", "duration", "priority", "checkpoint_interval"])
        for i in range(len(trace)):
            c = trace.checkpoint_interval[i]
            w.writerow([trace.ids[i], f"{trace.submit[i]:g}", int(trace.gpus[i]), f"{trace.duration[i]:g}",
                        int(trace.priority[i]), "" if math.isinf(c) else f"{c:g}"])


# --- importers: public traces in their native formats -------------------------------------------------

_PHILLY_TIME = "%Y-%m-%d %H:%M:%S"
_EPOCH = datetime(1970, 1, 1)


def _philly_time(v: object) -> float | None:
    if not isinstance(v, str) or not v or v == "None":
        return None
    try:
        return (datetime.strptime(v, _PHILLY_TIME) - _EPOCH).total_seconds()  # naive: no DST jumps
    except ValueError:
        return None


def read_philly(path: str | Path) -> Trace:
    """Microsoft Philly ``cluster_job_log`` (JSON list; format: github.com/msr-fiddle/philly-traces).

    A job's GPUs are those of its last attempt (``detail[].gpus`` summed over servers); its duration is the
    sum of its attempts' run times (the GPU time the cluster spent). Jobs with no attempt, no times, or
    still running at the snapshot (no ``end_time``) are skipped and counted in ``Trace.skipped``.
    """
    shown = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TraceError("trace not found", where=shown) from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"not valid JSON: {exc.msg} (line {exc.lineno})", where=shown, fix="pass Philly's cluster_job_log file") from None
    if not isinstance(data, list):
        raise TraceError("cluster_job_log must be a JSON list of jobs", where=shown, fix="pass Philly's cluster_job_log file")
    ids, submit, gpus, dur = [], [], [], []
    skipped: dict[str, int] = {}
    for n, job in enumerate(data):
        where = f"{shown}: job [{n}]"
        if not isinstance(job, dict) or "jobid" not in job or "submitted_time" not in job or "attempts" not in job:
            raise TraceError("a job needs jobid, submitted_time and attempts", where=where, fix="pass Philly's cluster_job_log file")
        sub = _philly_time(job["submitted_time"])
        attempts = job["attempts"] or []
        runs = []
        for a in attempts:
            s, e = _philly_time(a.get("start_time")), _philly_time(a.get("end_time"))
            if s is not None and e is not None and e >= s:
                runs.append(e - s)
        last = attempts[-1] if attempts else None
        if sub is None:
            reason = "no submitted_time"
        elif not attempts:
            reason = "no attempts"
        elif _philly_time(last.get("end_time")) is None:
            reason = "still running or no end_time"
        elif not runs or sum(runs) <= 0:
            reason = "no timed attempt"
        else:
            g = sum(len(d.get("gpus") or []) for d in (last.get("detail") or []))
            if g < 1:
                reason = "no GPUs"
            else:
                ids.append(str(job["jobid"]))
                submit.append(sub)
                gpus.append(g)
                dur.append(sum(runs))
                continue
        skipped[reason] = skipped.get(reason, 0) + 1
    if not ids:
        raise TraceError(f"no usable job in the log (skipped: {skipped})", where=shown)
    return Trace.from_columns(ids, submit, gpus, dur, source=f"philly:{shown}", skipped=skipped, sort=True).rebased()


PAI2020_JOB_COLUMNS = ("job_name", "inst_id", "user", "status", "start_time", "end_time")
PAI2020_TASK_COLUMNS = ("job_name", "task_name", "inst_num", "status", "start_time", "end_time", "plan_cpu", "plan_mem", "plan_gpu", "gpu_type")


def _pai_float(v: str) -> float | None:
    try:
        x = float(v)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def read_pai2020(task_table: str | Path, job_table: str | Path | None = None) -> Trace:
    """Alibaba PAI 2020 (github.com/alibaba/clusterdata, cluster-trace-gpu-v2020): ``pai_task_table.csv``
    (headerless, columns PAI2020_TASK_COLUMNS) and optionally ``pai_job_table.csv`` (PAI2020_JOB_COLUMNS).

    The GPU request lives in the task table: a job needs ceil(sum of inst_num x plan_gpu / 100) whole GPUs
    (plan_gpu is a percentage; fractional shares round up to whole GPUs here). Its duration is its last task
    end minus its first task start; its submit time is the job table's ``start_time`` (submission) when
    given, else its first task start. Jobs without a GPU request or times are skipped and counted.
    """
    tasks: dict[str, list[float]] = {}  # job -> [gpu_pct_sum, first_start, last_end]
    skipped: dict[str, int] = {}
    for row_no, row in _headerless(task_table, PAI2020_TASK_COLUMNS):
        job, inst, start, end, gpu = row[0], _pai_float(row[2]), _pai_float(row[4]), _pai_float(row[5]), _pai_float(row[8])
        if start is None or end is None or end <= start:
            skipped["task without times"] = skipped.get("task without times", 0) + 1
            continue
        t = tasks.setdefault(job, [0.0, start, end])
        t[0] += (inst or 1.0) * (gpu or 0.0)
        t[1], t[2] = min(t[1], start), max(t[2], end)
    submitted: dict[str, float] = {}
    if job_table is not None:
        for _, row in _headerless(job_table, PAI2020_JOB_COLUMNS):
            s = _pai_float(row[4])
            if s is not None:
                submitted[row[0]] = s
            if row[0] not in tasks:
                skipped["job without tasks"] = skipped.get("job without tasks", 0) + 1
    ids, submit, gpus, dur = [], [], [], []
    for job, (pct, start, end) in tasks.items():
        if pct <= 0:
            skipped["no GPU request"] = skipped.get("no GPU request", 0) + 1
            continue
        ids.append(job)
        submit.append(min(submitted.get(job, start), start))
        gpus.append(max(1, math.ceil(pct / 100.0 - 1e-9)))
        dur.append(end - start)
    if not ids:
        raise TraceError(f"no GPU job in the task table (skipped: {skipped})", where=str(task_table))
    return Trace.from_columns(ids, submit, gpus, dur, source=f"pai2020:{task_table}", skipped=skipped, sort=True).rebased()


def _headerless(path: str | Path, columns: Sequence[str]) -> Iterable[tuple[int, list[str]]]:
    shown = str(path)
    try:
        f = open(path, newline="", encoding="utf-8-sig")
    except FileNotFoundError:
        raise TraceError("trace table not found", where=shown) from None
    with f:
        for row_no, row in enumerate(csv.reader(f), start=1):
            if not row:
                continue
            if row_no == 1 and row[0] == columns[0]:
                continue  # a header row some copies carry
            if len(row) != len(columns):
                raise TraceError(f"{len(row)} columns, expected {len(columns)} ({','.join(columns)})", where=f"{shown}: row {row_no}",
                                 fix="pass the unmodified PAI table (headerless CSV)")
            yield row_no, row


POD2023_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos", "pod_phase",
                   "creation_time", "deletion_time", "scheduled_time")


def read_pai2023(path: str | Path) -> Trace:
    """Alibaba 2023 GPU trace pod list (``openb_pod_list_*.csv``, github.com/alibaba/clusterdata,
    cluster-trace-gpu-v2023): submit = ``creation_time``, duration = ``deletion_time - scheduled_time``,
    GPUs = ``num_gpu`` (a shared GPU, ``gpu_milli`` < 1000, counts as one whole GPU here). CPU-only pods
    and pods never scheduled (``Pending``, no ``scheduled_time``) are skipped and counted."""
    shown = str(path)
    try:
        f = open(path, newline="", encoding="utf-8-sig")
    except FileNotFoundError:
        raise TraceError("trace not found", where=shown) from None
    ids, submit, gpus, dur = [], [], [], []
    skipped: dict[str, int] = {}
    with f:
        reader = csv.reader(f)
        header = next(reader, [])
        missing = [c for c in POD2023_COLUMNS if c not in header]
        if missing:
            raise TraceError(f"missing column(s) {', '.join(missing)}", where=f"{shown}:1", fix="pass an unmodified openb_pod_list_*.csv")
        ix = {c: header.index(c) for c in POD2023_COLUMNS}
        for row_no, row in enumerate(reader, start=2):
            if len(row) != len(header):
                raise TraceError(f"{len(row)} fields, the header has {len(header)}", where=f"{shown}: row {row_no}")
            ng = row[ix["num_gpu"]].strip()
            try:
                g = int(float(ng)) if ng else 0
            except ValueError:
                raise TraceError(f"column 'num_gpu' must be a number, got {ng!r}", where=f"{shown}: row {row_no}") from None
            created, sched, deleted = (_pai_float(row[ix[c]]) for c in ("creation_time", "scheduled_time", "deletion_time"))
            if g < 1:
                reason = "CPU-only pod"
            elif sched is None or created is None:
                reason = "never scheduled"
            elif deleted is None or deleted <= sched:
                reason = "no run time"
            else:
                ids.append(row[ix["name"]])
                submit.append(created)
                gpus.append(g)
                dur.append(deleted - sched)
                continue
            skipped[reason] = skipped.get(reason, 0) + 1
    if not ids:
        raise TraceError(f"no GPU pod in the list (skipped: {skipped})", where=shown)
    return Trace.from_columns(ids, submit, gpus, dur, source=f"pai2023:{shown}", skipped=skipped, sort=True).rebased()


FORMATS = ("csv", "philly", "pai2020", "pai2023")


def read_trace(path: str | Path, fmt: str = "csv", *, job_table: str | Path | None = None) -> Trace:
    """Read a trace in one of FORMATS (``pai2020`` takes the task table as ``path``)."""
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}", fix=f"use one of: {', '.join(FORMATS)}")
    if job_table is not None and fmt != "pai2020":  # it was ignored, a typo'd path and all
        raise TraceError(f"--job-table is only read with --format pai2020 (the format is {fmt})",
                         fix="drop --job-table, or pass --format pai2020 with PAI's task table as the trace")
    # checked here once for every importer: each opens its file(s) its own way
    for p, what in ((path, "the trace"), (job_table, "--job-table")):
        if p is not None and Path(p).is_dir():
            raise TraceError(f"{what} is a directory, not a file", where=str(p), fix="pass the file itself")
    try:
        if fmt == "csv":
            return read_csv(path)
        if fmt == "philly":
            return read_philly(path)
        if fmt == "pai2020":
            return read_pai2020(path, job_table)
        return read_pai2023(path)
    except UnicodeDecodeError:
        files = f"{path} or {job_table}" if job_table is not None else str(path)
        raise TraceError("not a UTF-8 text file (a compressed or binary file?)", where=files,
                         fix=f"decompress it first, or check --format (now {fmt})") from None
