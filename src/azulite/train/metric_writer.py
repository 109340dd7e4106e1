"""The one writer of training metrics in a process: a daemon thread that owns the MLflow run and the
TensorBoard event file.

Why one thread and a queue: SQLite allows one writer at a time, and a training step must never wait for
one. Every producer (the training loop's ``log_metrics``, the checkpointer's commit figures, from
whichever thread reaps the commit) only puts a tuple on a ``queue.SimpleQueue`` — a put takes no Python
lock and never blocks — and this thread alone talks to the store. Nothing here runs in a signal handler
or holds a lock a signal handler could want (``Preemption`` only sets an Event).

Exit: ``atexit`` closes the writer with a bounded wait: it gives up on a store call that has made no
progress for :data:`CLOSE_TIMEOUT_S`, but waits (up to :data:`EXIT_WAIT_CAP_S`) for a writer still
connecting — importing MLflow and creating the run take seconds on a busy node, and a script that logs
its one metric at its last step (a sweep trial's objective) must not lose it. ``atexit`` callbacks run
after ``threading``'s own exit hooks, so a checkpoint the checkpointer commits as the interpreter exits
(a preempted rank's ``sys.exit(75)`` included) is queued before the writer drains. The thread is a
daemon: a store that never answers costs the exit at most the stall bound (or the cap), never a hang, and no join waits
for it. A failure to write is counted and said once; training never sees it.

TensorBoard files are written with TensorBoard's own record writer and protos, which need no TensorFlow
(its ``EventFileWriter`` reaches for ``tf.io.gfile``, importing all of TensorFlow when installed: seconds
at start and its chatter in rank 0's log), one file per process under ``<job dir>/tensorboard``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import logging
import os
import queue
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger("azulite.train.metrics")

TB_DIR = "tensorboard"
#: longest the exit waits for queued values to reach the store (a store that hangs costs this, no more;
#: ``AZULITE_METRICS_EXIT_WAIT_S`` overrides it). Well inside the launcher's preemption grace (60 s)
CLOSE_TIMEOUT_S = 10.0
#: longest the exit waits in all, a writer still connecting included (``AZULITE_METRICS_EXIT_WAIT_S``
#: overrides it): inside the launcher's preemption grace (60 s), so a preempted rank still exits 75
EXIT_WAIT_CAP_S = 45.0
#: values waiting beyond this are dropped (counted): a store stuck for long must not grow memory forever
MAX_PENDING = 100_000
#: MLflow's limit of metrics per log_batch call
_BATCH = 1000
#: the writer's shortest time between two store transactions (from its connection on): values arriving
#: closer together wait and go in one. A transaction costs about the same CPU for 1 value as for 5 (MLflow's
#: SQLAlchemy path, mostly under the GIL the training loop also needs; measured on a loaded 2-core machine:
#: ~7 ms for 1, ~8 ms for 5, the first one ~60 ms), so the DLRM example logging every 20 steps (~0.25 s)
#: paid ~0.4 ms of rank 0's ~12 ms steps for it. A flush or close writes at once.
#: ``AZULITE_METRICS_WRITE_INTERVAL_S`` overrides it (0: write as values come)
WRITE_INTERVAL_S = 5.0


class _Flush:
    """A marker in the queue: set once everything queued before it was handled."""

    def __init__(self) -> None:
        self.done = threading.Event()


_STOP = object()


class MetricWriter:
    """Writes (name -> value, step, wall time) to one MLflow run of ``uri`` and, with ``tb_dir``, to a
    TensorBoard event file, from its own thread. ``run_id``: log into that run (a script's own MLflow
    run) instead of creating one; a run created here is ended (FINISHED) at close."""

    def __init__(self, uri: str, *, experiment: str | None, tags: Mapping[str, str] | None = None,
                 run_id: str | None = None, tb_dir: str | None = None, inline: bool = False) -> None:
        self.uri, self.experiment, self.tags, self.tb_dir = uri, experiment, dict(tags or {}), tb_dir
        self.run_id = run_id
        self._own_run = run_id is None
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0  # approximate (no lock): only bounds memory
        self.written = 0
        self.failed = 0
        self.dropped = 0
        self._said = False
        self._closed = False
        self._client: Any = None
        self._tb: Any = None
        # what the writer thread is doing now, for close(): ("connect" | "write", monotonic start) or None
        self._busy: tuple[str, float] | None = None
        self._thread = threading.Thread(target=self._run, name="azulite-metrics", daemon=True)
        # inline: the caller writes (after the exit drain, when no writer thread is left)
        self._inline = inline
        if not inline:
            # MLflow's import chain reaches concurrent.futures.thread, whose import registers a threading
            # exit hook — refused once the interpreter is exiting ("can't register atexit after
            # shutdown"). Imported here (stdlib, milliseconds) so a connect still running at exit succeeds.
            import concurrent.futures.thread  # noqa: F401
            try:
                self._thread.start()
            except RuntimeError:  # interpreter shutting down: nothing else writes now, so this caller may
                self._inline = True

    # -- producers (any thread; never blocks) ---------------------------------------------------------
    def put(self, values: Mapping[str, float], step: int | None, wall_time: float | None = None) -> bool:
        """Queue values; False (and counted) when closed or too far behind."""
        item = (dict(values), step, time.time() if wall_time is None else wall_time)
        if self._inline and not self._closed:
            self._write([item])
            return True
        if self._closed or self._pending >= MAX_PENDING:
            self.dropped += len(values)
            self._say(f"{self.dropped} metric value(s) dropped ({'writer closed' if self._closed else 'store too far behind'})")
            return False
        self._pending += 1
        self._q.put(item)
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far was handled (written or counted as failed)."""
        if self._inline or self._closed:
            return True
        marker = _Flush()
        self._q.put(marker)
        return marker.done.wait(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued, end a run created here, close the event file. Returns whether everything
        queued was handled in time. ``timeout``: the longest wait in all; by default the wait ends when a
        store call has been stuck for :data:`CLOSE_TIMEOUT_S` (a connect may take up to the cap)."""
        if self._closed:
            return True
        cap = timeout
        if cap is None:
            try:  # a node whose preemption grace is long can wait longer for its last figures
                cap = float(os.environ.get("AZULITE_METRICS_EXIT_WAIT_S") or EXIT_WAIT_CAP_S)
            except ValueError:
                cap = EXIT_WAIT_CAP_S
        self._closed = True
        done = True
        if self._inline:
            self._finish()
        else:
            self._q.put(_STOP)
            t0 = time.monotonic()
            self._join(cap, stall=None if timeout is not None else CLOSE_TIMEOUT_S)
            done = not self._thread.is_alive()
            timeout = time.monotonic() - t0
            if not done:
                self._said = True  # the stuck thread says nothing more: no stderr write during interpreter teardown
                log.warning("metrics store %s did not take the last values within %.0fs; %d value(s) may be lost "
                            "(training results are unaffected)", self.uri, timeout, max(self._pending, 0))
        if self.failed or self.dropped:
            log.warning("%d metric value(s) could not be written and %d were dropped (store %s)",
                        self.failed, self.dropped, self.uri)
        return done

    def _join(self, cap: float, stall: float | None) -> None:
        """Wait for the writer thread to end: at most ``cap`` seconds, and with ``stall``, no longer than
        that past the start of a write that has not returned (a hung store). Connecting is not a stall."""
        end = time.monotonic() + cap
        while self._thread.is_alive():
            now = time.monotonic()
            if now >= end:
                return
            busy = self._busy
            if stall is not None and busy is not None and busy[0] == "write" and now - busy[1] >= stall:
                return
            # woken by the thread's end at once; the slice only bounds how late a stall is noticed
            self._thread.join(min(end - now, 0.05 if stall is None else max(stall / 20, 0.01)))

    # -- the writer thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        self._busy = ("connect", time.monotonic())
        try:  # connect now, not at the first value: importing MLflow takes seconds on a busy node, and a
            # first value queued just before a preempted exit would otherwise wait on it
            self._client = self._connect()
        except Exception:  # noqa: BLE001 - retried (and said) at the first write
            self._client = None
        self._busy = None
        interval = _write_interval()
        last_write = time.monotonic()
        while True:
            item = self._q.get()
            batch: list[tuple[dict[str, float], int | None, float]] = []
            markers: list[_Flush] = []
            stop = False
            while True:  # everything waiting, and what comes until the interval is up, goes in one transaction
                if item is _STOP:
                    stop = True
                elif isinstance(item, _Flush):
                    markers.append(item)
                else:
                    batch.append(item)
                wait = 0.0 if (stop or markers) else last_write + interval - time.monotonic()
                try:
                    item = self._q.get(timeout=wait) if wait > 0 else self._q.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._pending -= len(batch)
                self._busy = ("connect" if self._client is None else "write", time.monotonic())
                self._write(batch)
                self._busy = None
                last_write = time.monotonic()
            for m in markers:
                m.done.set()
            if stop:
                self._busy = ("write", time.monotonic())  # ending the run is a store call too
                self._finish()
                self._busy = None
                return

    def _write(self, batch: list[tuple[dict[str, float], int | None, float]]) -> None:
        n = sum(len(v) for v, _, _ in batch)
        try:
            self._mlflow(batch)
            self.written += n
        except Exception as e:  # noqa: BLE001 - the store is an observer: training goes on
            self.failed += n
            self._say(f"could not write metrics to {self.uri} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                      "training goes on, failures are counted")
        if self.tb_dir:
            try:
                self._tensorboard(batch)
            except Exception as e:  # noqa: BLE001
                self._say(f"could not write TensorBoard events to {self.tb_dir} ({type(e).__name__}: {e})")
                self.tb_dir = None

    def _say(self, message: str) -> None:
        if not self._said:
            self._said = True
            log.warning("%s", message)

    def _mlflow(self, batch: list[tuple[dict[str, float], int | None, float]]) -> None:
        from mlflow.entities import Metric

        if self._client is None:
            self._client = self._connect()
        metrics = [Metric(key=k, value=v, timestamp=int(t * 1000), step=step or 0)
                   for values, step, t in batch for k, v in values.items()]
        for i in range(0, len(metrics), _BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i:i + _BATCH], synchronous=True)

    def _connect(self) -> Any:
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its "creating tables" chatter is not ours
        with first_use_lock(self.uri):  # a fresh store's tables: one process of this machine at a time
            client = MlflowClient(tracking_uri=self.uri)
            if self.run_id is None:
                exp_id = "0"
                if self.experiment:
                    exp = client.get_experiment_by_name(self.experiment)
                    exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
                self.run_id = client.create_run(exp_id, tags=self.tags or None).info.run_id
        return client

    def _tensorboard(self, batch: list[tuple[dict[str, float], int | None, float]]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        if self._tb is None:
            from tensorboard.summary.writer.record_writer import RecordWriter

            os.makedirs(self.tb_dir, exist_ok=True)
            # TensorBoard's own file name pattern; one file per process, merged by TensorBoard per folder
            name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.azulite"
            self._tb = RecordWriter(open(os.path.join(self.tb_dir, name), "wb"))
            self._tb.write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
        for values, step, t in batch:
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
            self._tb.write(event_pb2.Event(wall_time=t, step=step or 0, summary=summary).SerializeToString())
        self._tb.flush()

    def _finish(self) -> None:
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError:
                pass
            self._tb = None
        if self._own_run and self._client is not None and self.run_id is not None:
            try:
                self._client.set_terminated(self.run_id, "FINISHED")
            except Exception as e:  # noqa: BLE001
                self._say(f"could not end MLflow run {self.run_id} ({type(e).__name__}: {e})")


def _write_interval() -> float:
    try:
        return max(0.0, float(os.environ.get("AZULITE_METRICS_WRITE_INTERVAL_S") or WRITE_INTERVAL_S))
    except ValueError:
        return WRITE_INTERVAL_S


# --- the process's writer ----------------------------------------------------------------------------------
_writer: MetricWriter | None = None
_key: tuple[Any, ...] | None = None
#: set by the exit drain: None while running; after it, whether the drained writer finished (then a late
#: value is written on its caller's thread, the one writer left), or not (then late values are dropped)
_exited: bool | None = None
# an RLock: taken only to create the writer (never around a write); re-entrant should anything on the
# same thread (a signal handler) ever get here mid-creation
_lock = threading.RLock()


def writer_for(uri: str, env: Mapping[str, str]) -> MetricWriter:
    """This process's writer for ``uri`` (created on first use; a different store closes the old one)."""
    global _writer, _key
    job_dir = env.get("AZULITE_JOB_DIR")
    tb_dir = os.path.join(job_dir, TB_DIR) if job_dir else None
    key = (uri, env.get("MLFLOW_EXPERIMENT_NAME"), tb_dir)
    w = _writer
    if w is not None and _key == key and not w._closed:
        return w
    with _lock:
        if _writer is not None and _key == key and not _writer._closed:
            return _writer
        if _writer is not None:
            _writer.close()
        tags = {k: env[v] for k, v in (("azulite.job_id", "AZULITE_JOB_ID"), ("azulite.attempt", "AZULITE_ATTEMPT")) if env.get(v)}
        _writer = MetricWriter(uri, experiment=env.get("MLFLOW_EXPERIMENT_NAME"), tags=tags,
                               run_id=_scripts_own_run(), tb_dir=tb_dir, inline=_exited is not None)
        if _exited is False:
            _writer._closed = True  # the drained writer is still stuck in the store: never a second writer
        _key = key
        return _writer


def _scripts_own_run() -> str | None:
    """The run a script started with MLflow's own API on this thread (Azure ML style), so its values and
    azulite's land in one run. Only when the script imported mlflow already: no import on the caller."""
    import sys

    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return None
    try:
        run = mlflow.active_run()
    except Exception:  # noqa: BLE001
        return None
    return run.info.run_id if run is not None else None


def current() -> MetricWriter | None:
    return _writer


def close(timeout: float | None = None) -> bool:
    """Flush and close this process's writer (at exit; also callable by a script)."""
    global _writer
    with _lock:
        w, _writer = _writer, None
    return True if w is None else w.close(timeout)


def _at_exit() -> None:
    global _exited
    _exited = close()


def _forget_in_child() -> None:
    """A forked child (a data-loader worker) has a copy of the writer but not its thread: start over."""
    global _writer, _key, _lock, _exited
    _writer, _key, _lock, _exited = None, None, threading.RLock(), None


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)


@contextlib.contextmanager
def first_use_lock(uri: str) -> Iterator[None]:
    """Serialises the first contact with a fresh SQLite store (MLflow creates its tables then; two
    processes doing it at once collide) between the processes of this machine. The lock file lies beside
    a SQLite store's file (``mlflow.db.lock``: it goes with the job's folder), or in the temporary folder
    for another kind of store or a folder that cannot hold it."""
    key = hashlib.sha1(uri.encode()).hexdigest()[:16]
    fallback = os.path.join(tempfile.gettempdir(), f"azulite-mlflow-{key}.lock")
    try:
        if not uri.startswith("sqlite:///"):
            raise OSError
        f = open(uri[len("sqlite:///"):].split("?", 1)[0] + ".lock", "a")
    except OSError:
        f = open(fallback, "a")
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield
