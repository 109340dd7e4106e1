"""One driver process per sweep job: ``python -m azulite.launch.local.sweeper SWEEP_ID``.

Started detached by ``LocalBackend.submit`` for a ``type: sweep`` spec, as the supervisor is for a
command job. It runs the sweep's trials as ordinary child jobs through the same backend (ids
``<sweep id>-trial-<n>``, each with its own supervisor, MLflow store and logs), up to
``max_concurrent_trials`` at a time, asks the sampler for values and tells it each trial's primary metric
(the last value the trial logged), stops trials early by the sweep's policy, and keeps the sweep's state
in ``<sweep dir>/sweep.json`` (trials, values, metrics, the best trial), which ``job show`` prints. A
primary metric that the first finished trial never logged fails the sweep then, not at the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from azulite.errors import AzuliteError, SweepError
from azulite.launch.backend import get_backend
from azulite.launch.early_stop import due_at, should_stop
from azulite.launch.local.procs import wait_any_exit
from azulite.launch.local.store import JobStore
from azulite.launch.records import JobState
from azulite.launch.sampling import Sampler, better, make_sampler
from azulite.launch.settings import Settings
from azulite.launch.tracking import metric_history
from azulite.spec.job import JobSpec
from azulite.spec.sweep import SweepSpec

POLL_S = 0.5
STATE_FILE = "sweep.json"


@dataclass
class Trial:
    id: str
    values: dict[str, Any]
    state: str = "running"
    metric: float | None = None
    reports: list[float] = field(default_factory=list)
    early_terminated: bool = False
    evaluated: int = 0  # the last evaluation point (report count) the policy looked at
    token: Any = None
    supervisor_pid: int | None = None  # the trial's own supervisor, once it has recorded itself


def read_state(job_dir: str | Path) -> dict[str, Any] | None:
    """The sweep's state as its driver last wrote it (None before the first write)."""
    try:
        return json.loads((Path(job_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_state(job_dir: str | Path, state: dict[str, Any]) -> None:
    """Replace the sweep's state file whole (a reader never sees half of one)."""
    tmp = Path(job_dir) / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=1, default=str))
    os.replace(tmp, Path(job_dir) / STATE_FILE)


class Sweeper:
    def __init__(self, store: JobStore, settings: Settings, sweep_id: str, environ: dict[str, str]) -> None:
        self.store, self.settings, self.sweep_id, self.environ = store, settings, sweep_id, environ
        self.backend = get_backend("local", settings, environ)
        self.trials: list[Trial] = []
        self._cancel = False

    def _on_term(self, *_: object) -> None:
        self._cancel = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        self.store.set_fields(self.sweep_id, supervisor_pid=os.getpid())
        rec = self.store.get(self.sweep_id)
        self.job_dir = Path(rec.job_dir)
        try:
            spec = SweepSpec.model_validate(rec.spec)
            if not self.store.transition(self.sweep_id, JobState.RUNNING, attempt=1, message="sweep started"):
                return 0
            state, message, code = self._loop(spec, make_sampler(spec))
        except AzuliteError as exc:
            state, message, code = JobState.FAILED, str(exc), 1
        except BaseException as exc:  # a sweep must never stay "running" behind a dead driver
            traceback.print_exc()
            state, message, code = JobState.FAILED, f"sweep driver error: {exc!r}", 1
        self._cancel_running("the sweep ended")
        self._write(spec if "spec" in locals() else None)
        self.store.transition(self.sweep_id, state, message=message, exit_code=code)
        return 0

    def _loop(self, spec: SweepSpec, sampler: Sampler) -> tuple[JobState, str, int | None]:
        """The sweep's end: (state, message, exit code), the codes a command job records: 0, a failure's 1,
        124 for a timeout (the sweep's limits.timeout, as a job's timeout), none for a cancel."""
        limits = spec.limits
        deadline = time.monotonic() + limits.timeout if limits.timeout else None
        exhausted = timed_out = False
        while True:
            if self._cancel or self.store.flags(self.sweep_id)[0]:
                return JobState.CANCELED, "canceled by user", None
            self._poll(spec, sampler)
            if spec.early_termination is not None:
                self._early_stop(spec)
            if not timed_out and deadline is not None and time.monotonic() > deadline:
                timed_out = True
                self.store.event(self.sweep_id, f"timed out after {limits.timeout:g}s (limits.timeout)")
                self._cancel_running(f"the sweep's timeout ({limits.timeout:g}s) passed", spec.objective.primary_metric)
            running = [t for t in self.trials if t.state == "running"]
            while (not timed_out and not exhausted and len(running) < limits.max_concurrent_trials
                   and len(self.trials) < limits.max_total_trials):
                asked = sampler.ask()
                if asked is None:
                    exhausted = True
                    break
                values, token = asked
                trial = Trial(id="", values=values, token=token)
                trial.id = self._submit(spec, values)
                self.trials.append(trial)
                running.append(trial)
            self._write(spec)
            if not running:
                best, metric = self._best(spec), spec.objective.primary_metric
                stopped = f"timed out after {limits.timeout:g}s (limits.timeout)" if timed_out else ""
                if best is None and timed_out:
                    return JobState.FAILED, f"{stopped} before any trial reported {metric!r}", 124
                if best is None:
                    return JobState.FAILED, f"no trial reported {metric!r}", 1
                return JobState.SUCCEEDED, (f"{stopped + ': ' if stopped else ''}{len(self.trials)} trial(s); best "
                                            f"{best.id}: {metric}={best.metric:g} {best.values}"), 0
            # a trial's end wakes this at once (its supervisor exits right after recording it): the next
            # trial starts then, not at the next tick; the interval paces the metric reads of running
            # trials (early termination) and the looks for a cancel
            wait_any_exit([t.supervisor_pid for t in running if t.supervisor_pid], POLL_S)

    def _submit(self, spec: SweepSpec, values: dict[str, Any]) -> str:
        job = spec.trial_spec(values)
        job = job.model_copy(update={
            "name": f"{self.sweep_id}-trial",
            "environment_variables": {**job.environment_variables, "AZULITE_SWEEP_ID": self.sweep_id},
        })
        rec = self.backend.submit(job)
        self.store.event(self.sweep_id, f"trial {rec.id}: {values}")
        return rec.id

    def _poll(self, spec: SweepSpec, sampler: Sampler) -> None:
        metric = spec.objective.primary_metric
        for t in self.trials:
            if t.state != "running":
                continue
            rec = self.backend.status(t.id)
            t.supervisor_pid = rec.supervisor_pid
            if not rec.state.terminal and spec.early_termination is None:
                continue  # its reports matter only to a policy, or once it has ended
            t.reports = metric_history(JobSpec.model_validate(rec.spec), rec.job_dir, metric)
            if not rec.state.terminal:
                continue
            t.state = "early_terminated" if t.early_terminated else rec.state.value
            t.metric = t.reports[-1] if t.reports else None
            sampler.tell(t.token, t.metric if rec.state == JobState.SUCCEEDED else None)
            if rec.state == JobState.SUCCEEDED and t.metric is None:
                raise SweepError(
                    f"trial {t.id} succeeded without logging the primary metric {metric!r}",
                    where="objective.primary_metric",
                    fix="log it from the trial (mlflow.log_metric or azulite.train.log_metrics) or name a metric it logs")

    def _early_stop(self, spec: SweepSpec) -> None:
        reports = {t.id: t.reports for t in self.trials if t.reports}
        policy = spec.early_termination
        for t in self.trials:
            if t.state != "running" or t.early_terminated or t.id not in reports:
                continue
            point = due_at(policy, len(t.reports))
            if point <= t.evaluated:  # each evaluation point once
                continue
            t.evaluated = point
            if should_stop(policy, spec.objective, t.id, reports):
                t.early_terminated = True
                self.store.event(self.sweep_id, f"trial {t.id} stopped early ({spec.early_termination.type}) "
                                 f"after {len(t.reports)} report(s)")
                self.backend.cancel(t.id)
                # its own record says why (it read "canceled by user", as if someone had)
                self.store.set_fields(t.id, reason=f"stopped early by sweep {self.sweep_id}'s "
                                                   f"{spec.early_termination.type} policy after {len(t.reports)} report(s)")

    def _cancel_running(self, why: str, metric: str | None = None) -> None:
        """Stop the running trials (``why`` in their records too); with ``metric``, what each reported of
        it so far is kept as its result (a sweep's timeout: the trials stopped then had logged their loss,
        and the sweep said "no trial reported 'loss'")."""
        for t in self.trials:
            if t.state == "running":
                self.store.event(self.sweep_id, f"canceling trial {t.id}: {why}")
                self.backend.cancel(t.id)
                self.store.set_fields(t.id, reason=f"canceled by sweep {self.sweep_id}: {why}")
                rec = self.backend.status(t.id)
                t.state = rec.state.value
                if metric is not None:
                    t.reports = metric_history(JobSpec.model_validate(rec.spec), rec.job_dir, metric)
                    t.metric = t.reports[-1] if t.reports else None

    def _best(self, spec: SweepSpec) -> Trial | None:
        """The best metric of the trials that reported one and did not fail: succeeded, stopped early, or
        stopped by the sweep's timeout (as Azure ML picks its best child run)."""
        best = None
        for t in self.trials:
            if t.state != JobState.FAILED.value and t.metric is not None:
                if best is None or better(spec.objective, t.metric, best.metric):
                    best = t
        return best

    def _write(self, spec: SweepSpec | None) -> None:
        best = self._best(spec) if spec is not None else None
        state = {
            "primary_metric": spec.objective.primary_metric if spec else None,
            "goal": spec.objective.goal if spec else None,
            "trials": [{"id": t.id, "values": t.values, "state": t.state, "metric": t.metric,
                        "reports": len(t.reports), "early_terminated": t.early_terminated} for t in self.trials],
            "best_trial": best.id if best else None,
        }
        write_state(self.job_dir, state)


def timeout_field(store: JobStore, spec: JobSpec) -> str | None:
    """What gave a sweep's trial its timeout, as the sweep's file names it: ``limits.trial_timeout of sweep
    ID`` or ``trial.timeout of sweep ID``; None for a job that is not a trial (its own ``timeout``)."""
    sweep_id = spec.environment_variables.get("AZULITE_SWEEP_ID")
    if not sweep_id:
        return None
    try:
        sweep = SweepSpec.model_validate(store.get(sweep_id).spec)
    except (AzuliteError, ValueError):  # the sweep's record gone, or not a sweep's: say what the job knows
        return None
    own = sweep.trial.get("timeout") is not None
    return f"{'trial.timeout' if own else 'limits.trial_timeout'} of sweep {sweep_id}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m azulite.launch.local.sweeper SWEEP_ID", file=sys.stderr)
        return 2
    environ = dict(os.environ)
    settings = Settings.from_environ(environ)
    return Sweeper(JobStore(settings.db_path), settings, argv[0], environ).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
