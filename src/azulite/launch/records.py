"""What every backend reports about a job: typed records, the same for local, kubernetes and azureml."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

from azulite.contract import EXIT_PREEMPTED


class JobState(str, Enum):
    """queued -> running -> succeeded | failed | canceled | preempted; preempted -> requeued -> running.
    A failed attempt with retries left also goes running -> requeued."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    PREEMPTED = "preempted"
    REQUEUED = "requeued"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED)


#: allowed transitions; anything else is a bug and the store refuses it
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELED, JobState.FAILED}),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED, JobState.PREEMPTED, JobState.REQUEUED}
    ),
    JobState.PREEMPTED: frozenset({JobState.REQUEUED, JobState.CANCELED, JobState.FAILED}),
    JobState.REQUEUED: frozenset({JobState.RUNNING, JobState.CANCELED, JobState.FAILED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELED: frozenset(),
}


@dataclass
class ProcessRecord:
    """One OS process of an attempt: an agent/worker/mpirun (``kind="agent"``) or a rank (``kind="rank"``)."""

    attempt: int
    kind: str
    name: str
    node: int
    rank: int | None
    local_rank: int | None
    pid: int | None
    exit_code: int | None
    log: str | None
    restarts: int = 0


@dataclass
class AttemptRecord:
    attempt: int
    state: str
    started_at: float | None
    ended_at: float | None
    exit_code: int | None
    reason: str | None


@dataclass
class JobRecord:
    id: str
    name: str
    backend: str
    state: JobState
    attempt: int
    created_at: float
    started_at: float | None
    ended_at: float | None
    exit_code: int | None
    reason: str | None
    spec: dict
    spec_path: str | None
    environment: str | None
    job_dir: str
    supervisor_pid: int | None
    failed_rank: int | None = None
    processes: list[ProcessRecord] = field(default_factory=list)
    attempts: list[AttemptRecord] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        d["state"] = self.state.value
        if isinstance(d.get("supervisor_pid"), int) and d["supervisor_pid"] < 0:
            d["supervisor_pid"] = None  # a recovery's claim token (-time), not a process
        return d


def retries_used(rec: JobRecord) -> int:
    """Attempts that ended in a failure and were retried (preemption requeues, exit 75, do not count)."""
    return sum(1 for a in rec.attempts if a.state == JobState.REQUEUED.value and a.exit_code != EXIT_PREEMPTED)
