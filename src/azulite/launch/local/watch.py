"""What ``azulite agent`` runs: a long-lived look at every local job that has not ended.

A job's supervisor can die (killed, out of memory, the machine restarted). Any ``azulite`` command that
looks at the job notices and requeues it from its last committed checkpoint (``LocalBackend.status``,
within ``max_retries``), but on a machine where nobody types a command the job would wait. The agent is
that look on a clock: every ``interval`` seconds it asks the backend for the status of each job not yet
ended (which is where recovery happens) and reports what its look changed. It owns no state and writes
nothing itself, so any number of agents and commands may look at once (the store's conditional claim
lets exactly one of them start the new supervisor).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from azulite.errors import JobNotFound
from azulite.launch.local.backend import LocalBackend
from azulite.launch.records import JobRecord, JobState


@dataclass(frozen=True)
class Change:
    """A job whose state or attempt changed while the agent looked at it (a recovery, mostly). A requeued
    job's attempt is the one it was requeued as (the store keeps the ended attempt's number until the new
    supervisor starts it)."""

    job_id: str
    before: str
    after: str
    attempt_before: int
    attempt_after: int
    reason: str | None

    def __str__(self) -> str:
        return (f"{self.job_id}: {self.before} (attempt {self.attempt_before}) -> {self.after} "
                f"(attempt {self.attempt_after})" + (f": {self.reason}" if self.reason else ""))


def _attempt(rec: JobRecord) -> int:
    """The attempt a job is at: a requeued job's next one (it said "retry N as attempt A")."""
    return rec.attempt + 1 if rec.state == JobState.REQUEUED else rec.attempt


def look(backend: LocalBackend) -> list[Change]:
    """One look at every job not ended; the changes it caused."""
    changes = []
    for rec in backend.store.active():
        try:
            now = backend.status(rec.id)
        except JobNotFound:  # removed meanwhile
            continue
        if (now.state, now.attempt) != (rec.state, rec.attempt):
            why = now.events[-1]["message"] if now.events else now.reason  # the transition's own words
            changes.append(Change(rec.id, rec.state.value, now.state.value, _attempt(rec), _attempt(now), why))
    return changes


def watch(backend: LocalBackend, *, interval: float, stop: threading.Event,
          report: Callable[[Change], None]) -> int:
    """Look every ``interval`` seconds until ``stop`` is set; returns how many looks were made."""
    looks = 0
    while True:
        for change in look(backend):
            report(change)
        looks += 1
        if stop.wait(interval):
            return looks
