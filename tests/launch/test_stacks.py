"""A preempted job whose rank never stops: before the supervisor SIGKILLs it at the preempt grace, the
rank's every thread's stack lands in the rank's log and the supervisor's view of the processes in its own
log, so a hang seen once in CI can be read afterwards (issue 9)."""

from __future__ import annotations

from pathlib import Path

from azulite.launch.records import JobState
from azulite.spec.loader import load_job
from tests.launch.jobkit import backend, home, wait_done, wait_for, write_job, spec_2x1

_ = home  # fixture

# Calls azulite.train.init (which registers the dump signal), then ignores the preemption's SIGTERM in a
# function whose name the stack must show; attempt 2 finishes at once.
STUCK_ON_PREEMPT = """
import os, signal, sys, threading
if os.environ["AZULITE_ATTEMPT"] != "1":
    sys.exit(0)
from azulite import train
train.init({})
signal.signal(signal.SIGTERM, signal.SIG_IGN)

def stuck_in_a_collective():
    open("started", "w").close()
    threading.Event().wait()

stuck_in_a_collective()
"""


def test_a_preempted_rank_that_never_stops_has_its_stack_in_its_log_before_the_kill(home, tmp_path, monkeypatch):
    monkeypatch.setenv("AZULITE_PREEMPT_GRACE_S", "1")
    # the rank runner's own dump (20 s after the stop) off: this one comes from the supervisor
    spec = write_job(tmp_path / "stuck", STUCK_ON_PREEMPT, spec_2x1(
        nodes=1, per_node=1, extra="environment_variables:\n      AZULITE_STOP_DUMP_S: '0'"))
    b = backend()
    rec = b.submit(load_job(spec))
    node = Path(rec.job_dir) / "nodes" / "node-0"
    wait_for(lambda: (node / "started").exists(), 120, "the rank to start")
    b.preempt(rec.id)
    rec = wait_done(rec.id)
    assert rec.state == JobState.SUCCEEDED, rec.reason
    assert [(a.attempt, a.state) for a in rec.attempts] == [(1, "requeued"), (2, "succeeded")], rec.attempts
    log = Path(rec.job_dir, "attempt-1", "logs", "rank-0.log").read_text()
    assert "in stuck_in_a_collective" in log, log  # the rank's own stack, written before the SIGKILL
    assert "launch/local/rank.py\", line" in log, log  # and its rank runner's
    event = next(e["message"] for e in rec.events if "for their stacks" in (e.get("message") or ""))
    assert "still running 1s after the preempt SIGTERM: asked 2 process(es) of rank(s) [0]" in event, event
    sup = Path(rec.job_dir, "supervisor.log").read_text()
    assert "attempt 1 still running 1s after the preempt SIGTERM; its processes:" in sup
    assert "torch.distributed.run" in sup and "azulite.launch.local.rank" in sup  # the launcher and the runner
