"""Each job's MLflow tracking store: where its ranks log metrics, and the last value of each metric.

A local job gets its own store, ``sqlite:///<job dir>/mlflow.db`` (MLflow's file store is in maintenance
mode; SQLite is its recommended local backend), with the experiment named as Azure ML names it
(``experiment_name``, else the job's name). A job whose ``environment_variables`` set
``MLFLOW_TRACKING_URI`` logs there instead (a shared server, an Azure ML workspace); ``job show`` then
reads that store. The launcher puts a ready store in place before the first attempt — a copy of an empty
one whose tables MLflow created once per machine and MLflow version — so no rank and no reader ever
races MLflow's table creation on a fresh file (a reader that opens a half-made store breaks it).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from azulite.errors import MetricsError
from azulite.spec.job import JobSpec

STORE_FILE = "mlflow.db"


def store_uri(job_dir: str | Path) -> str:
    return f"sqlite:///{Path(job_dir).resolve() / STORE_FILE}"


def experiment_name(spec: JobSpec) -> str:
    return str(spec.azureml.get("experiment_name") or spec.name)


def tracking_env(spec: JobSpec, job_dir: str | Path) -> dict[str, str]:
    """What every rank of the job gets: the store and the experiment (MLflow's own variables)."""
    uri = spec.environment_variables.get("MLFLOW_TRACKING_URI") or store_uri(job_dir)
    return {"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": experiment_name(spec)}


def prepare_store(spec: JobSpec, job_dir: str | Path) -> Path | None:
    """Put an empty, fully created store at the job's own URI (nothing when the spec names another one,
    or it is there already). Returns its path."""
    if tracking_env(spec, job_dir)["MLFLOW_TRACKING_URI"] != store_uri(job_dir):
        return None
    dest = Path(job_dir).resolve() / STORE_FILE
    if not dest.exists():
        tmp = dest.with_name(f".{STORE_FILE}.{os.getpid()}.tmp")
        shutil.copyfile(_template(), tmp)
        os.replace(tmp, dest)
    return dest


def drop_if_empty(job_dir: str | Path) -> bool:
    """At the job's end: remove its store if no run was ever logged to it (a job that logs nothing keeps no
    store, and no megabyte of MLflow's empty schema per job). True if removed."""
    dest = Path(job_dir) / STORE_FILE
    if not dest.exists():
        return False
    rows = _query_store(str(dest), "SELECT COUNT(*) FROM runs", ())
    if rows is None or rows[0][0]:
        return False
    for path in (dest, dest.with_name(dest.name + "-wal"), dest.with_name(dest.name + "-shm")):
        path.unlink(missing_ok=True)
    return True


def _template() -> Path:
    """An empty MLflow SQLite store for this machine and MLflow version, made once (under a file lock)."""
    try:
        version = metadata.version("mlflow-skinny")
    except metadata.PackageNotFoundError:
        version = metadata.version("mlflow")
    path = Path(tempfile.gettempdir()) / f"azulite-mlflow-{version}-uid{os.getuid()}.db"
    if path.exists():
        return path
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            logging.getLogger("mlflow").setLevel(logging.WARNING)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            store = SqlAlchemyStore(f"sqlite:///{tmp}", str(tmp.parent / "azulite-mlflow-artifacts"))
            store.engine.dispose()  # closed: the one file holds everything (no journal left to copy)
            os.replace(tmp, path)
    return path


def last_metrics(spec: JobSpec, job_dir: str | Path, *, job_id: str | None = None) -> dict[str, dict[str, Any]]:
    """name -> {"value", "step", "timestamp"} of the newest value of every metric the job logged, across
    its runs (a requeued attempt starts a new run; the later value wins). {} when nothing was logged."""
    env = tracking_env(spec, job_dir)
    uri = env["MLFLOW_TRACKING_URI"]
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///"):]):
        return {}  # nothing logged yet; opening it would create it
    if uri == store_uri(job_dir):
        fast = _latest_from_sqlite(uri[len("sqlite:///"):], env["MLFLOW_EXPERIMENT_NAME"])
        if fast is not None:
            return fast
    try:
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its "creating tables" chatter is not ours
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(env["MLFLOW_EXPERIMENT_NAME"])
        if exp is None:
            return {}
        filter_ = f"tags.`azulite.job_id` = '{job_id}'" if job_id and uri != store_uri(job_dir) else ""
        runs = client.search_runs([exp.experiment_id], filter_string=filter_, max_results=1000)
        out: dict[str, dict[str, Any]] = {}
        for run in sorted(runs, key=lambda r: r.info.start_time or 0):
            for name in run.data.metrics:
                history = client.get_metric_history(run.info.run_id, name)
                if history:  # MLflow's own "latest": the highest step, then the newest
                    m = max(history, key=lambda m: (m.step, m.timestamp))
                    out[name] = {"value": m.value, "step": m.step, "timestamp": m.timestamp}
        return out
    except ImportError:
        raise MetricsError("mlflow is not installed: metrics cannot be read", where=uri,
                           fix="pip install mlflow-skinny") from None
    except Exception as e:  # noqa: BLE001 - any store failure is one user-facing problem
        raise MetricsError(f"cannot read metrics from {uri}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                           where=uri, fix="check that the tracking store is reachable") from None


def _query_store(path: str, sql: str, params: tuple) -> list[tuple] | None:
    """Rows of one query on a job's MLflow SQLite store opened read-only; None when the store cannot
    answer it (not MLflow's schema, locked past the timeout, not a database)."""
    import sqlite3

    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            return db.execute(sql, params).fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return None


def _latest_from_sqlite(path: str, experiment: str) -> dict[str, dict[str, Any]] | None:
    """The job's own store read directly, read-only: `job show` answers in milliseconds instead of paying
    for importing MLflow (~1 s, far more on a busy machine, for every look at a running job). It reads
    MLflow's own ``latest_metrics`` table (MLflow's "latest": the highest step, then the newest); None when
    the schema is not what this expects, and the caller asks MLflow itself."""
    rows = _query_store(
        path, "SELECT lm.key, lm.value, lm.step, lm.timestamp FROM latest_metrics lm "
        "JOIN runs r ON r.run_uuid = lm.run_uuid JOIN experiments e ON e.experiment_id = r.experiment_id "
        "WHERE e.name = ? AND r.lifecycle_stage = 'active' ORDER BY r.start_time, r.run_uuid", (experiment,))
    if rows is None:
        return None
    # a requeued attempt is a later run: its values win
    return {key: {"value": value, "step": step, "timestamp": ts} for key, value, step, ts in rows}


def metric_history(spec: JobSpec, job_dir: str | Path, name: str) -> list[float]:
    """Every value of metric ``name`` the job logged, in step order (its runs in start order); [] when none."""
    env = tracking_env(spec, job_dir)
    uri = env["MLFLOW_TRACKING_URI"]
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///"):]):
        return []
    if uri == store_uri(job_dir):
        fast = _history_from_sqlite(uri[len("sqlite:///"):], env["MLFLOW_EXPERIMENT_NAME"], name)
        if fast is not None:
            return fast
    return _history_from_mlflow(uri, env["MLFLOW_EXPERIMENT_NAME"], name)


def _history_from_sqlite(path: str, experiment: str, name: str) -> list[float] | None:
    """:func:`metric_history` from the job's own store read directly, read-only, as ``_latest_from_sqlite``
    does: a sweep's driver reads each trial's objective from it, and importing MLflow for that cost the
    driver ~1.5 CPU-seconds (and each trial's store another engine and schema check) beside the trials'
    ranks on the same cores. Values as MLflow's client gives them (a NaN is stored as 0 with ``is_nan``);
    None when the schema is not what this expects."""
    rows = _query_store(
        path, "SELECT m.value, m.is_nan FROM metrics m JOIN runs r ON r.run_uuid = m.run_uuid "
        "JOIN experiments e ON e.experiment_id = r.experiment_id "
        "WHERE e.name = ? AND m.key = ? AND r.lifecycle_stage = 'active' "
        "ORDER BY r.start_time, r.run_uuid, m.step, m.timestamp", (experiment, name))
    if rows is None:
        return None
    return [float("nan") if is_nan else float(value) for value, is_nan in rows]


def _history_from_mlflow(uri: str, experiment: str, name: str) -> list[float]:
    try:
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return []
        out: list[float] = []
        for run in sorted(client.search_runs([exp.experiment_id], max_results=1000), key=lambda r: r.info.start_time or 0):
            if name in run.data.metrics:
                out += [m.value for m in sorted(client.get_metric_history(run.info.run_id, name),
                                                key=lambda m: (m.step, m.timestamp))]
        return out
    except Exception as e:  # noqa: BLE001
        raise MetricsError(f"cannot read metric {name!r} from {uri}: {type(e).__name__}: {e}", where=uri,
                           fix="check that the tracking store is reachable") from None


def metric_series(job_dir: str | Path, names: tuple[str, ...]) -> dict[str, dict[int, float | None]] | None:
    """step -> value of each metric in ``names`` from the job's own store, read-only through SQLite (the
    dashboard polls it while rank 0 writes; MLflow's client would open it read-write). A requeued attempt
    is a later run: its value for a step wins. NaN/Inf come back as None. None when the job has no store
    of its own or its schema is not what this expects."""
    import math
    import sqlite3

    path = Path(job_dir) / STORE_FILE
    if not path.exists() or not names:
        return None
    marks = ",".join("?" * len(names))
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            rows = db.execute(
                f"SELECT m.key, m.step, m.value, m.is_nan FROM metrics m JOIN runs r ON r.run_uuid = m.run_uuid "
                f"WHERE r.lifecycle_stage = 'active' AND m.key IN ({marks}) "
                f"ORDER BY r.start_time, r.run_uuid, m.step, m.timestamp", names).fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return None
    out: dict[str, dict[int, float | None]] = {name: {} for name in names}
    for key, step, value, is_nan in rows:
        out[key][int(step)] = None if is_nan or value is None or not math.isfinite(value) else float(value)
    return out
