"""Each job's MLflow tracking store: where its ranks log metrics, and the last value of each metric.

A local job gets its own store, ``sqlite:///<job dir>/mlflow.db`` (MLflow's file store is in maintenance
mode; SQLite is its recommended local backend), with the experiment named as Azure ML names it
(``experiment_name``, else the job's name). A job whose ``environment_variables`` set
``MLFLOW_TRACKING_URI`` logs there instead (a shared server, an Azure ML workspace); ``job show`` then
reads that store. The store is created by the first process that logs, never by the launcher, so a job
that logs nothing pays nothing for it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
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


def last_metrics(spec: JobSpec, job_dir: str | Path, *, job_id: str | None = None) -> dict[str, dict[str, Any]]:
    """name -> {"value", "step", "timestamp"} of the newest value of every metric the job logged, across
    its runs (a requeued attempt starts a new run; the later value wins). {} when nothing was logged."""
    env = tracking_env(spec, job_dir)
    uri = env["MLFLOW_TRACKING_URI"]
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///"):]):
        return {}  # nothing logged yet; opening it would create it
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
