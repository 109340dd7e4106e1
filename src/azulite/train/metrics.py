"""Training metrics through MLflow, as scripts on Azure ML log them.

The launcher points every rank at the job's tracking store (``MLFLOW_TRACKING_URI``, and
``MLFLOW_EXPERIMENT_NAME``); a script may call ``mlflow.log_metric`` itself, exactly as on Azure ML, or
:func:`log_metrics`, which logs from rank 0 only (every rank holds the same averaged loss; N copies would
only collide) and does nothing when no store is configured (a script run by hand still runs). MLflow is
the one store of training metrics: ``azulite job show`` and sweeps read it back.

    from azulite import train
    train.log_metrics({"loss": loss.item(), "lr": lr}, step=step)
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from azulite.errors import MetricsError

log = logging.getLogger("azulite.train.metrics")

#: the variables the first one of which names this process's global rank, per launcher contract
_RANK_VARS = ("RANK", "AZULITE_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def global_rank(environ: Mapping[str, str]) -> int:
    for name in _RANK_VARS:
        raw = environ.get(name)
        if raw not in (None, ""):
            try:
                return int(raw)
            except ValueError:
                raise MetricsError(f"{name}={raw!r} is not an integer", where="environment",
                                   fix=f"unset {name} or set it to this process's rank") from None
    return 0


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, *, environ: Mapping[str, str] | None = None) -> bool:
    """Log ``metrics`` (name -> number) at ``step`` to the job's MLflow store, from rank 0. Returns whether
    anything was logged: False on other ranks and when ``MLFLOW_TRACKING_URI`` is not set."""
    env = os.environ if environ is None else environ
    values = {}
    for name, value in metrics.items():
        try:
            values[str(name)] = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError):
            raise MetricsError(f"metric {name!r} = {value!r} is not a number", where=f"log_metrics({name!r})",
                               fix="log plain numbers or 0-d tensors, e.g. loss.item()") from None
    uri = env.get("MLFLOW_TRACKING_URI")
    if not uri or global_rank(env) != 0 or not values:
        return False
    try:
        import mlflow
    except ImportError:
        raise MetricsError("MLFLOW_TRACKING_URI is set but mlflow is not installed", where="log_metrics",
                           fix="pip install mlflow-skinny (azulite's install does), or unset MLFLOW_TRACKING_URI") from None
    with _first_use_lock(uri):
        if mlflow.active_run() is None:
            tags = {k: env[v] for k, v in (("azulite.job_id", "AZULITE_JOB_ID"), ("azulite.attempt", "AZULITE_ATTEMPT")) if env.get(v)}
            mlflow.start_run(tags=tags or None)
    mlflow.log_metrics(values, step=step)
    return True


class _first_use_lock:
    """Serialises the first contact with a fresh SQLite store (MLflow creates its tables then; two
    processes doing it at once collide) between the processes of this machine."""

    def __init__(self, uri: str) -> None:
        key = hashlib.sha1(uri.encode()).hexdigest()[:16]
        self._path = os.path.join(tempfile.gettempdir(), f"azulite-mlflow-{key}.lock")
        self._f: Any = None

    def __enter__(self) -> None:
        self._f = open(self._path, "a")
        fcntl.flock(self._f, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()
