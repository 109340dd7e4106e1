"""``azulite agent``'s look (launch/local/watch.py): what it reports of a job it requeued."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from azulite.launch.local.watch import look
from azulite.launch.records import JobRecord, JobState


def _rec(state: JobState, attempt: int, message: str | None = None) -> JobRecord:
    return JobRecord(id="j-1", name="j", backend="local", state=state, attempt=attempt, created_at=0.0,
                     started_at=None, ended_at=None, exit_code=None, reason=None, spec={}, spec_path=None,
                     environment=None, job_dir="/nonexistent", supervisor_pid=None,
                     events=[{"message": message}] if message else [])


def _backend(before: JobRecord, after: JobRecord) -> SimpleNamespace:
    return SimpleNamespace(store=SimpleNamespace(active=lambda: [before]), status=lambda job_id: after)


def test_a_requeue_reports_the_attempt_the_job_is_requeued_as():
    """It said attempt_before 1, attempt_after 1 ("running (attempt 1) -> requeued (attempt 1)") while the
    job was requeued as attempt 2: the store keeps the ended attempt's number until the new one starts."""
    running = _rec(JobState.RUNNING, 1)
    requeued = _rec(JobState.REQUEUED, 1, "supervisor died; retry 1/1 as attempt 2")
    (change,) = look(_backend(running, requeued))
    assert (change.before, change.attempt_before, change.after, change.attempt_after) == ("running", 1, "requeued", 2)
    assert str(change).startswith("j-1: running (attempt 1) -> requeued (attempt 2): supervisor died")
    # the next look, once the new supervisor started it: the same attempt, now running
    (change,) = look(_backend(requeued, replace(requeued, state=JobState.RUNNING, attempt=2, events=[])))
    assert (change.attempt_before, change.after, change.attempt_after) == (2, "running", 2)
    assert look(_backend(running, running)) == []
