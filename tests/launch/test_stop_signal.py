"""`job preempt` stops every process of a rank with exactly one SIGTERM, under every distribution: a second
one landing after a script's handler returned (Python restores the default action on its way out) turned
its exit 75 into 143 — measured before the fix, with 2-3 SIGTERMs per rank (the supervisor's to the whole
tree, torchrun's killpg, the rank runner's forward). Also: a command run through a shell keeps the script's
75 (the shell waits for it), and under mpirun a rank that commits later than its peers is not killed by
Open MPI for the first one's exit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from azulite.launch.local import mpi
from azulite.launch.local.context import build_context
from azulite.launch.local.strategy import get_strategy
from azulite.launch.records import JobState
from azulite.spec.loader import load_job
from tests.launch.jobkit import backend, home, wait_done, wait_for, write_job

_ = home  # fixture
pytestmark = pytest.mark.slow
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI (mpirun) not installed")

# Counts the SIGTERMs delivered to it: Python's C-level handler writes one byte per delivery to the wakeup
# fd (its Python handler runs once for signals that land close together). After the first it keeps counting
# for 1 + rank seconds (room for a duplicate to land: one comes within milliseconds, and with none sent the
# wait cannot fail the test; the ranks also finish apart, which under mpirun is the case the rank hold is
# for), then writes the count, "commits" and exits 75. Attempt 2 ends at once.
COUNTER = """
import os, signal, sys, time
e = os.environ
rank = int(e.get("RANK") or e.get("AZULITE_RANK") or 0)
out = e["AZULITE_OUTPUT_STATE"]
if int(e["AZULITE_ATTEMPT"]) > 1:
    sys.exit(0)
r, w = os.pipe()
os.set_blocking(w, False)
signal.set_wakeup_fd(w, warn_on_full_buffer=False)
signal.signal(signal.SIGTERM, lambda *_: None)
open(os.path.join(out, f"started-{rank}"), "w").close()
got = os.read(r, 64)  # blocks until the first delivery
t = time.monotonic()
while time.monotonic() - t < 1 + rank:
    time.sleep(0.02)
os.set_blocking(r, False)
try:
    got += os.read(r, 64)
except BlockingIOError:
    pass
open(os.path.join(out, f"sigterms-{rank}"), "w").write(str(got.count(signal.SIGTERM)))
sys.exit(75)
"""

DISTRIBUTIONS = {
    "none": ("", 1, 1),
    "pytorch": ("distribution:\n      type: pytorch\n      process_count_per_instance: 1", 2, 2),
    "tensorflow": ("distribution:\n      type: tensorflow\n      worker_count: 2", 2, 2),
    "mpi": ("distribution:\n      type: mpi\n      process_count_per_instance: 2", 1, 2),
}


def _spec(distribution: str, nodes: int, command: str) -> str:
    return f"""
    name: stop
    code: .
    command: {command}
    instance_count: {nodes}
    {distribution}
    outputs:
      state:
        type: uri_folder
        path: state
    """


@pytest.mark.parametrize("dist, command", [
    ("none", "python run.py"),
    ("pytorch", "python run.py"),
    # through /bin/sh (not its last command, which a shell may exec): the shell waits and says the script's 75
    ("pytorch", "python run.py && echo done"),
    ("tensorflow", "python run.py"),
    pytest.param("mpi", "python run.py", marks=needs_mpirun),
])
def test_preempt_stops_each_rank_with_one_sigterm_and_keeps_its_75(home, tmp_path, dist, command):
    distribution, nodes, ranks = DISTRIBUTIONS[dist]
    spec = write_job(tmp_path / "job", COUNTER, _spec(distribution, nodes, command))
    state = tmp_path / "job" / "state"
    b = backend()
    rec = b.submit(load_job(spec))
    wait_for(lambda: all((state / f"started-{r}").exists() for r in range(ranks)) or b.status(rec.id).state.terminal,
             120, "every rank to start")
    b.preempt(rec.id)
    rec = wait_done(rec.id)
    got = {r: (state / f"sigterms-{r}").read_text() if (state / f"sigterms-{r}").exists() else None
           for r in range(ranks)}
    assert got == {r: "1" for r in range(ranks)}, got
    first = {p.rank: p.exit_code for p in rec.processes if p.kind == "rank" and p.attempt == 1}
    assert first == {r: 75 for r in range(ranks)}, first
    assert rec.state == JobState.SUCCEEDED, rec.reason
    assert [(a.attempt, a.state) for a in rec.attempts] == [(1, "requeued"), (2, "succeeded")], rec.attempts


# ---- the mpi strategy's stop targets and rank hold, on real processes -------------------------------------

def _mpi_ctx(tmp_path: Path):
    spec = load_job(write_job(tmp_path / "m", "", _spec(DISTRIBUTIONS["mpi"][0], 1, "python run.py")))
    job_dir = tmp_path / "jobs" / "m-1"
    shutil.copytree(tmp_path / "m", job_dir / "code")
    ctx = build_context("m-1", 1, spec, job_dir, {"PATH": os.environ["PATH"]})
    ctx.records_dir.mkdir(parents=True, exist_ok=True)
    return ctx


def _record(ctx, rank: int, pid: int, exit_code: int | None) -> None:
    ctx.rank_record(rank).write_text(json.dumps({"rank": rank, "pid": pid, "exit_code": exit_code}))


@pytest.fixture
def sleepers():
    procs: list[subprocess.Popen] = []

    def start(own_group: bool) -> int:
        procs.append(subprocess.Popen(["sleep", "300"], start_new_session=own_group))
        return procs[-1].pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_mpi_stops_the_ranks_own_groups_and_mpirun_only_when_it_must(tmp_path, sleepers):
    ctx = _mpi_ctx(tmp_path)
    strategy = get_strategy("mpi")
    launchers = {"mpirun": 4242}
    assert strategy.stop_groups(ctx, launchers) == [4242]  # no rank started: nothing to commit, mpirun ends it
    r0, r1 = sleepers(True), sleepers(True)
    _record(ctx, 0, r0, None)
    assert strategy.stop_groups(ctx, launchers) == [4242]  # rank 1 not started yet
    _record(ctx, 1, r1, None)
    assert sorted(strategy.stop_groups(ctx, launchers)) == sorted([r0, r1])  # each leads its group
    _record(ctx, 1, r1, 75)
    assert strategy.stop_groups(ctx, launchers) == [r0]  # an ended rank gets nothing
    _record(ctx, 1, sleepers(False), None)  # a rank in this process's group: killpg would reach us too
    assert strategy.stop_groups(ctx, launchers) == [4242]


def test_a_preempted_mpi_rank_holds_until_every_rank_has_ended(tmp_path):
    ctx = _mpi_ctx(tmp_path)
    _record(ctx, 0, 1, 75)
    _record(ctx, 1, 2, None)
    assert mpi.hold_for_peers(ctx.records_dir, 2, max_s=0.2) is False  # rank 1 still committing: bounded
    _record(ctx, 1, 2, 75)
    assert mpi.hold_for_peers(ctx.records_dir, 2, max_s=3600) is True  # returns as soon as all ended


@needs_mpirun
def test_the_mpi_shim_holds_a_75_until_its_peers_end(tmp_path):
    """The shim itself (as mpirun runs it): rank 0 exits 75 and stays while rank 1 has no end; once rank 1's
    end is written the shim exits with the 75."""
    records, logs = tmp_path / "ranks", tmp_path / "logs"
    records.mkdir()
    (records / "rank-1.json").write_text('{"rank": 1, "pid": 1, "exit_code": null}')
    env = {**os.environ, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    shim = subprocess.Popen([sys.executable, "-m", "azulite.launch.local.mpi", "--node", "0", "--per-node", "2",
                             "--records", str(records), "--logs", str(logs), "--", sys.executable, "-c",
                             "raise SystemExit(75)"], env=env, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: '"exit_code": 75' in (records / "rank-0.json").read_text()
                 if (records / "rank-0.json").exists() else False, 60, "rank 0's end")
        assert shim.poll() is None  # held: its exit would make mpirun kill rank 1 mid-commit
        (records / "rank-1.json").write_text('{"rank": 1, "pid": 1, "exit_code": 75}')
        assert shim.wait(timeout=60) == 75
    finally:
        shim.kill()
        shim.wait()
