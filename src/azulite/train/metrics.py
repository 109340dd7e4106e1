"""Training metrics through MLflow, as scripts on Azure ML log them.

The launcher points every rank at the job's tracking store (``MLFLOW_TRACKING_URI``, and
``MLFLOW_EXPERIMENT_NAME``); a script may call ``mlflow.log_metric`` itself, exactly as on Azure ML, or
:func:`log_metrics`, which logs from rank 0 only (every rank holds the same averaged loss; N copies would
only collide) and does nothing when no store is configured (a script run by hand still runs). MLflow is
the one store of training metrics: ``azulite job show``, sweeps and the dashboard read it back.

Nothing here writes the store on the caller's thread: values go to the process's one writer thread
(:mod:`azulite.train.metric_writer`), so a step never waits for SQLite and two threads never write it.

    from azulite import train
    train.log_metrics({"loss": loss.item(), "lr": lr}, step=step)
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from azulite.errors import MetricsError
from azulite.train import metric_writer

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


#: (step, perf_counter) of this process's previous log_metrics call with a step: step time is measured
#: between calls, so a script pays nothing for it
_last_step: tuple[int, float] | None = None
_have_mlflow: bool | None = None
#: wall time of this process's last committed checkpoint (its age is measured from it)
_last_commit: float | None = None
_said_ck = False


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, *, batch_size: int | None = None,
                environ: Mapping[str, str] | None = None) -> bool:
    """Log ``metrics`` (name -> number) at ``step`` to the job's MLflow store, from rank 0. Returns whether
    anything was queued: False on other ranks and when ``MLFLOW_TRACKING_URI`` is not set.

    The values go to this process's one metrics writer (:mod:`azulite.train.metric_writer`): the call
    costs a queue put, the store is written on the writer's thread and drained at exit. Called once per
    logged step it adds ``step_time_s`` (wall time per step since its previous call) and, given
    ``batch_size`` (the global batch: samples per step over all ranks), ``samples_per_s``; a script's own
    values of either win. In a job (``AZULITE_JOB_DIR`` set) the same values also go to TensorBoard event
    files under ``<job dir>/tensorboard``: ``tensorboard --logdir <job dir>`` opens them."""
    global _last_step
    env = os.environ if environ is None else environ
    values = _numbers(metrics)
    if step is not None:
        now = time.perf_counter()
        if _last_step is not None and step > _last_step[0]:
            per_step = (now - _last_step[1]) / (step - _last_step[0])
            values.setdefault("step_time_s", per_step)
            if batch_size and per_step > 0:
                values.setdefault("samples_per_s", batch_size / per_step)
        _last_step = (step, now)
    return _queue(values, step, env)


def checkpoint_committed(step: int, save_seconds: float, *, environ: Mapping[str, str] | None = None) -> bool:
    """Record a committed checkpoint: ``checkpoint_save_s`` (save() to commit), ``checkpoint_committed_unix``
    and ``checkpoint_age_s`` (how old the previous checkpoint was when this one replaced it: what the
    'checkpoint older than its interval x k' alert watches). A queue put: safe from any thread."""
    global _last_commit
    now = time.time()
    values = {"checkpoint_save_s": float(save_seconds), "checkpoint_committed_unix": now}
    if _last_commit is not None:
        values["checkpoint_age_s"] = now - _last_commit
    _last_commit = now
    try:
        return _queue(values, step, os.environ if environ is None else environ)
    except MetricsError as e:  # a checkpoint never fails for its figures (said once)
        global _said_ck
        if not _said_ck:
            _said_ck = True
            log.warning("checkpoint figures not logged: %s", e)
        return False


#: how long :func:`warm_up` waits, when asked to, for rank 0's writer to connect (import MLflow, open the
#: store, start the run)
WARM_UP_WAIT_S = 20.0


def warm_up(environ: Mapping[str, str] | None = None, *, wait: float | None = None) -> None:
    """Start rank 0's metrics writer, which connects on its own thread, and wait until it is connected: at
    most ``wait`` seconds (:data:`WARM_UP_WAIT_S` when None; 0: no wait). ``train.init`` and the
    checkpointer start it without waiting: MLflow's import and the run's creation (1-2 CPU-seconds) then
    overlap the rendezvous and the restore instead of preceding a (re)started rank's first step, and values
    logged meanwhile queue and are written, in order, once it is connected (the exit waits for a connect
    in progress). A workload that would rather pay for it before its first step than beside its first
    steps (the thread takes CPU from ranks sharing the node's cores) waits."""
    env = os.environ if environ is None else environ
    uri = env.get("MLFLOW_TRACKING_URI")
    try:
        if uri and global_rank(env) == 0 and importlib.util.find_spec("mlflow") is not None:
            w = metric_writer.writer_for(uri, env)
            wait = WARM_UP_WAIT_S if wait is None else wait
            if wait > 0:
                w.flush(wait)
    except MetricsError:
        pass


def flush(timeout: float | None = 30.0) -> bool:
    """Wait until every value queued so far is in the store (True), or ``timeout`` passed (False)."""
    w = metric_writer.current()
    return True if w is None else w.flush(timeout)


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    values = {}
    for name, value in metrics.items():
        try:
            values[str(name)] = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError):
            raise MetricsError(f"metric {name!r} = {value!r} is not a number", where=f"log_metrics({name!r})",
                               fix="log plain numbers or 0-d tensors, e.g. loss.item()") from None
    return values


def _queue(values: dict[str, float], step: int | None, env: Mapping[str, str]) -> bool:
    uri = env.get("MLFLOW_TRACKING_URI")
    if not uri or global_rank(env) != 0 or not values:
        return False
    global _have_mlflow
    if _have_mlflow is None:
        _have_mlflow = importlib.util.find_spec("mlflow") is not None
    if not _have_mlflow:
        raise MetricsError("MLFLOW_TRACKING_URI is set but mlflow is not installed", where="log_metrics",
                           fix="pip install mlflow-skinny (azulite's install does), or unset MLFLOW_TRACKING_URI")
    return metric_writer.writer_for(uri, env).put(values, step)
