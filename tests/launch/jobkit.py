"""Shared by the launch and CLI job tests: an isolated AZULITE_HOME, tiny job scripts, polling helpers,
and a teardown that proves (and enforces) that no process of any test job is left alive."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest

from azulite.contract import ENV_JOB_ID
from azulite.launch.backend import get_backend
from azulite.launch.local.procs import terminate_tree
from azulite.launch.records import JobRecord
from azulite.launch.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def job_procs(prefix_ids: set[str] | None = None, home: Path | None = None) -> list[psutil.Process]:
    """Live processes of this test's jobs (ids in ``prefix_ids``, or all) — scoped to the current
    AZULITE_HOME by the AZULITE_JOB_DIR marker, so parallel test runs elsewhere are never touched — and,
    with ``home``, the supervisors of that home."""
    jobs_dir = Settings.from_environ().jobs_dir if home is None else Settings(home=home).jobs_dir
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            env = p.environ()
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.Error, OSError):
            continue
        job_dir = env.get("AZULITE_JOB_DIR", "")
        if job_dir and Path(job_dir).parent == jobs_dir and env.get(ENV_JOB_ID) and (
            prefix_ids is None or env.get(ENV_JOB_ID) in prefix_ids
        ):
            found.append(p)
        elif home is not None and env.get("AZULITE_HOME") == str(home) and p.pid != os.getpid():
            try:
                if "azulite.launch.local.supervisor" in " ".join(p.cmdline()):
                    found.append(p)
            except psutil.Error:
                pass
    return found


def wait_for(pred: Callable[[], object], timeout: float, what: str, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """AZULITE_HOME in tmp_path, a fast kill grace; on teardown every job of it is canceled and no process
    of it may remain."""
    h = tmp_path / "azhome"
    monkeypatch.setenv("AZULITE_HOME", str(h))
    monkeypatch.setenv("AZULITE_KILL_GRACE_S", "3")
    monkeypatch.setenv("AZULITE_PREEMPT_GRACE_S", "30")
    monkeypatch.setenv("AZULITE_PEER_GRACE_S", "1")
    yield h
    clean_home(h)


def clean_home(h: Path) -> None:
    """Cancels every job of the AZULITE_HOME ``h`` (which must be the current one) and fails if any
    process of it remains."""
    settings = Settings.from_environ()
    ids = set()
    if settings.db_path.exists():
        b = get_backend("local", settings)
        for r in b.list(1000):
            ids.add(r.id)
            if not r.state.terminal:
                b.cancel(r.id)
    # a supervisor may still be exiting right after writing the final state
    deadline = time.monotonic() + 30
    while (left := job_procs(ids, home=h)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        terminate_tree([p.pid for p in left], 2)
    assert not left, f"processes left behind: {[(p.pid, p.info) for p in left]}"


def backend():
    return get_backend("local", Settings.from_environ())


def wait_done(job_id: str, timeout: float = 180) -> JobRecord:
    b = backend()
    return wait_for(lambda: (r := b.status(job_id)).state.terminal and r, timeout, f"{job_id} to end")


def write_job(d: Path, script: str, spec: str) -> Path:
    """A job folder with ``run.py`` and ``job.yaml``."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "run.py").write_text(textwrap.dedent(script))
    (d / "job.yaml").write_text(textwrap.dedent(spec))
    return d / "job.yaml"


# A rank that fails: rank 1 prints a few lines and exits 3; the others wait to be stopped.
FAILING_RANK = """
import os, sys, time
rank = int(os.environ["RANK"])
for i in range(30):
    print(f"rank {rank} line {i}", flush=True)
if rank == 1:
    print("rank 1: something broke", flush=True)
    sys.exit(3)
time.sleep(60)
"""

# Sleeps until killed, after starting a detached grandchild (an orphan-to-be) to prove the sweep.
SLEEPER = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
open(f"started-{os.environ['RANK']}", "w").close()
print("sleeping", flush=True)
time.sleep(300)
"""

# The preemption contract, minimal: on SIGTERM, "commit" and exit 75; attempt 2 finishes at once.
PREEMPTIBLE = """
import os, signal, sys, time
attempt = int(os.environ["AZULITE_ATTEMPT"])
rank = int(os.environ["RANK"])
out = os.environ["AZULITE_OUTPUT_STATE"]
if attempt > 1:
    print(f"rank {rank} resumed in attempt {attempt}", flush=True)
    sys.exit(0)
stop = False
def on_term(*_):
    global stop
    stop = True
signal.signal(signal.SIGTERM, on_term)
open(os.path.join(out, f"started-{rank}"), "w").close()
while not stop:
    time.sleep(0.05)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a later notice (a kubelet's, an event's) must not make this 143
open(os.path.join(out, f"committed-{rank}"), "w").close()
sys.exit(75)
"""


def spec_2x1(command: str = "python run.py", extra: str = "", *, nodes: int = 2, per_node: int = 1) -> str:
    """2 simulated nodes x 1 process by default (cross-node); ``nodes=1, per_node=2`` costs one agent less."""
    return f"""
    name: t
    code: .
    command: {command}
    instance_count: {nodes}
    distribution:
      type: pytorch
      process_count_per_instance: {per_node}
    {extra}
    """
