"""``azulite agent`` through the real console script: with nothing else looking at the store, it requeues a
job whose supervisor was killed (the new attempt succeeds), reports it, and stops on SIGTERM."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from azulite.launch.local.store import JobStore
from azulite.launch.records import JobState
from azulite.launch.settings import Settings
from azulite.spec.loader import load_job
from tests.launch.jobkit import REPO, backend, home, spec_2x1, wait_for, write_job

_ = home
AZULITE = [str(Path(sys.executable).parent / "azulite")]

SLEEP_THEN_FINISH = """
import os, sys, time
if os.environ["AZULITE_ATTEMPT"] != "1":
    sys.exit(0)
open(f"started-{os.environ['RANK']}", "w").close()
time.sleep(300)
"""


@pytest.mark.slow
def test_the_agent_requeues_a_job_whose_supervisor_died_with_no_command_run(home, tmp_path):
    spec = write_job(tmp_path / "sd", SLEEP_THEN_FINISH, spec_2x1(extra="max_retries: 1", nodes=1, per_node=1))
    rec = backend().submit(load_job(spec))
    # from here on the test reads the store only: a backend status/list would notice the death itself
    store = JobStore(Settings.from_environ().db_path)
    agent = subprocess.Popen([*AZULITE, "agent", "--interval", "0.3", "--json"], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (Path(rec.job_dir) / "nodes/node-0/started-0").exists(), 120, "the rank to start")
        first = store.get(rec.id).supervisor_pid
        psutil.Process(first).kill()
        done = wait_for(lambda: (r := store.get(rec.id)).state.terminal and r, 120, "the agent to requeue the job")
    finally:
        agent.send_signal(signal.SIGTERM)
        out, err = agent.communicate(timeout=60)
    assert agent.returncode == 0, err
    assert done.state == JobState.SUCCEEDED, done.reason
    assert [(a.attempt, a.state) for a in done.attempts] == [(1, "requeued"), (2, "succeeded")]
    assert "supervisor died" in done.attempts[0].reason and done.supervisor_pid != first
    # its report: the job it requeued (seen just after the requeue, or once the new supervisor started it)
    first = [json.loads(line) for line in out.splitlines()][0]
    assert (first["job_id"], first["before"], first["attempt_before"]) == (rec.id, "running", 1), out
    assert (first["after"] == "requeued" and "supervisor died" in first["reason"]) or \
        (first["after"], first["attempt_after"]) == ("running", 2), first
    assert "stopped after" in err


@pytest.mark.parametrize("interval", ["0", "-1", "inf", "nan", "1e12", "86401"])
def test_the_agent_refuses_a_bad_interval(home, interval):
    """inf and 1e12 ended in an OverflowError traceback (exit 1): the wait's timeout overflowed."""
    p = subprocess.run([*AZULITE, "agent", "--interval", interval], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 2 and "--interval" in p.stderr and "at most 86400" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


def test_the_agent_refuses_another_backend(home):
    p = subprocess.run([*AZULITE, "agent"], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "AZULITE_BACKEND": "kubernetes"})
    assert p.returncode == 2 and "AZULITE_BACKEND" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_burst_of_stop_signals_stops_the_agent_without_deadlock(home):
    """SIGTERM and SIGINT as fast as they can be sent, from the moment the agent looks: its handler only
    writes a byte, so a signal landing while the main thread (or a first handler) holds the stop event's
    lock cannot hang it (the handler that set the event itself hung the agent in 2 of ~30 bursts here)."""
    agent = subprocess.Popen([*AZULITE, "agent", "--interval", "0.001"], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert "looking after" in agent.stderr.readline()
        for i in range(300):
            try:
                agent.send_signal(signal.SIGTERM if i % 2 else signal.SIGINT)
            except ProcessLookupError:
                break
        out, err = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    # a signal of the burst that lands after the interpreter began to exit (handlers back to default) ends
    # it by that signal: the agent had stopped (it said so); a deadlock shows as the timeout above
    assert "stopped after" in err and agent.returncode in (0, -signal.SIGTERM, -signal.SIGINT), \
        (agent.returncode, err)
