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
import queue
import tempfile
import threading
import time
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


#: (step, perf_counter) of this process's previous log_metrics call with a step: step time is measured
#: between calls, so a script pays nothing for it
_last_step: tuple[int, float] | None = None
TB_DIR = "tensorboard"
#: (tracking URI, run id) of the run this process logs to, whichever thread started it
_run_id: tuple[str, str] | None = None
_run_lock = threading.Lock()


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, *, batch_size: int | None = None,
                environ: Mapping[str, str] | None = None) -> bool:
    """Log ``metrics`` (name -> number) at ``step`` to the job's MLflow store, from rank 0. Returns whether
    anything was logged: False on other ranks and when ``MLFLOW_TRACKING_URI`` is not set.

    Called once per logged step, it adds ``step_time_s`` (wall time per step since the previous call) and,
    given ``batch_size`` (the global batch: samples per step over all ranks), ``samples_per_s``. In a job
    (``AZULITE_JOB_DIR`` set) the same values also go to TensorBoard event files under
    ``<job dir>/tensorboard`` so ``tensorboard --logdir <job dir>`` opens them."""
    global _last_step
    env = os.environ if environ is None else environ
    metrics = dict(metrics)
    if step is not None:
        now = time.perf_counter()
        if _last_step is not None and step > _last_step[0]:
            per_step = (now - _last_step[1]) / (step - _last_step[0])
            metrics.setdefault("step_time_s", per_step)  # a script's own figure wins
            if batch_size and per_step > 0:
                metrics["samples_per_s"] = batch_size / per_step
        _last_step = (step, now)
    return _write(metrics, step, env)


def _write(metrics: Mapping[str, Any], step: int | None, env: Mapping[str, str]) -> bool:
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
    global _run_id
    with _run_lock, _first_use_lock(uri):
        if _run_id is None or _run_id[0] != uri:
            run = mlflow.active_run()
            if run is not None and _run_id is not None:  # the store changed (tests, or a script's own reset)
                mlflow.end_run()
                run = None
            if run is None:
                tags = {k: env[v] for k, v in (("azulite.job_id", "AZULITE_JOB_ID"), ("azulite.attempt", "AZULITE_ATTEMPT")) if env.get(v)}
                run = mlflow.start_run(tags=tags or None)
            _run_id = (uri, run.info.run_id)
    # by run id: MLflow's active run is per thread, and the checkpointer's figures come from another one
    mlflow.log_metrics(values, step=step, run_id=_run_id[1])
    with _run_lock:
        _tensorboard(env, values, step)
    return True


_tb_writer: Any = None
_tb_said = False


def _tensorboard(env: Mapping[str, str], values: Mapping[str, float], step: int | None) -> None:
    global _tb_writer, _tb_said
    job_dir = env.get("AZULITE_JOB_DIR")
    if not job_dir:
        return
    log_dir = os.path.join(job_dir, TB_DIR)
    if _tb_writer is not None and _tb_writer.log_dir != log_dir:
        _tb_writer.close()
        _tb_writer = None
    if _tb_writer is None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package; MLflow still has every value
            if not _tb_said:
                log.warning("tensorboard is not installed: no TensorBoard event files (MLflow has the metrics)")
                _tb_said = True
            return
        # one file per attempt (an attempt is a process): TensorBoard merges the files of one folder
        _tb_writer = SummaryWriter(log_dir=log_dir, flush_secs=10)
    for name, value in values.items():
        _tb_writer.add_scalar(name, value, global_step=step)
    _tb_writer.flush()


class _Later:
    """Metrics logged off the caller's thread: the checkpointer hands its figures over with a queue put
    (its commit may be reaped on the training thread; an SQLite write there would stall a step)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[dict[str, float], int | None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, values: dict[str, float], step: int | None) -> None:
        exiting = False
        with self._lock:
            if self._thread is None:
                try:  # drained before interpreter teardown, as the checkpointer's last commit is
                    threading._register_atexit(self.drain)  # type: ignore[attr-defined]
                    self._thread = threading.Thread(target=self._run, name="azulite-metrics", daemon=True)
                    self._thread.start()
                except RuntimeError:  # already exiting (that last commit itself): log here, nothing waits now
                    exiting = True
        if exiting:
            self._log(values, step)
        else:
            self._q.put((values, step))

    @staticmethod
    def _log(values: dict[str, float], step: int | None) -> None:
        try:
            _log_values(values, step)
        except Exception as e:  # noqa: BLE001 - a metrics store problem never stops training
            log.warning("could not log %s: %s", sorted(values), e)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            self._log(*item)

    def drain(self) -> None:
        """Log what is queued, then stop the thread (a later put starts a new one)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._q.put(None)
            thread.join(timeout=60)


_later = _Later()


def _log_values(values: dict[str, float], step: int | None) -> None:
    _write(values, step, os.environ)  # not a training step: step time stays measured between the script's calls


def log_metrics_later(values: Mapping[str, float], step: int | None = None) -> None:
    """Queue ``values`` for :func:`log_metrics` on a background thread; costs the caller a queue put."""
    if os.environ.get("MLFLOW_TRACKING_URI"):  # no store: no thread either
        _later.put(dict(values), step)


def flush_later() -> None:
    """Block until every queued value is logged."""
    _later.drain()


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
