"""The local backend end to end with real torchrun agents on loopback: failing rank, cancel without
orphans, preemption -> requeue -> success, port in use, a job that outlives its submitter."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from azulite.errors import LaunchError
from azulite.launch.local.procs import port_in_use
from azulite.launch.records import JobState
from azulite.spec.loader import load_job
from tests.launch.jobkit import (
    FAILING_RANK, PREEMPTIBLE, REPO, SLEEPER, backend, home, job_procs, spec_2x1, wait_done, wait_for, write_job,
)

pytestmark = pytest.mark.slow
_ = home  # fixture


def test_failing_rank_fails_the_job_with_its_exit_code(home, tmp_path):
    spec = write_job(tmp_path / "fail", FAILING_RANK, spec_2x1())
    rec = backend().submit(load_job(spec))
    rec = wait_done(rec.id)
    assert rec.state == JobState.FAILED
    assert rec.exit_code == 3 and rec.failed_rank == 1, rec.reason
    assert "rank 1" in rec.reason
    ranks = {p.rank: p for p in rec.processes if p.kind == "rank"}
    assert ranks[1].exit_code == 3
    assert ranks[0].exit_code != 0  # stopped by the supervisor after its peer died, not left running
    log = Path(ranks[1].log).read_text().splitlines()
    assert log[-1] == "rank 1: something broke"
    assert not job_procs({rec.id})


def test_a_command_that_does_not_exist_fails_127_with_a_message_not_a_traceback(home, tmp_path):
    spec = write_job(tmp_path / "typo", "print('x')\n", spec_2x1("pyhton run.py", nodes=1, per_node=1))
    rec = wait_done(backend().submit(load_job(spec)).id)
    assert (rec.state, rec.exit_code) == (JobState.FAILED, 127), rec.reason
    log = Path(next(p.log for p in rec.processes if p.kind == "rank")).read_text()
    assert "cannot run 'pyhton': No such file or directory" in log and "Traceback" not in log


def test_cancel_ends_every_process_including_orphans(home, tmp_path):
    spec = write_job(tmp_path / "sleep", SLEEPER, spec_2x1())
    b = backend()
    rec = b.submit(load_job(spec))
    job_dir = Path(rec.job_dir)
    wait_for(lambda: all((job_dir / "nodes" / f"node-{n}" / f"started-{n}").exists() for n in (0, 1))
             or b.status(rec.id).state.terminal, 120, "both ranks to start")
    assert b.status(rec.id).state == JobState.RUNNING
    before = job_procs({rec.id})
    # 2 agents, 2 rank runners, 2 shells, 2 scripts, 2 detached grandchildren (at least)
    assert len(before) >= 8, [p.cmdline() for p in before]
    sup = psutil.Process(b.status(rec.id).supervisor_pid)
    rec = b.cancel(rec.id)
    assert rec.state == JobState.CANCELED
    wait_for(lambda: not job_procs({rec.id}), 20, "all job processes to end")
    for p in before + [sup]:
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE, p
    # the stopped agents say how they ended: the supervisor's tree kill reaped them, and they read as 0
    agents = [p.exit_code for p in b.status(rec.id).processes if p.kind == "agent"]
    assert len(agents) == 2 and 0 not in agents and None not in agents, agents


def _preempted_once(folder: Path, script: str):
    """A 2-node job of ``script`` preempted once both ranks started: (its record once ended, its state folder)."""
    spec = write_job(folder, script, spec_2x1(extra="outputs:\n      state:\n        type: uri_folder\n        path: state"))
    state = folder / "state"
    b = backend()
    rec = b.submit(load_job(spec))
    wait_for(lambda: (state / "started-0").exists() and (state / "started-1").exists(), 120, "ranks to start")
    b.preempt(rec.id)
    return wait_done(rec.id), state


def test_a_preemption_whose_save_fails_is_a_failure_not_a_preemption(home, tmp_path):
    """A rank that cannot commit its preemption save exits 1 (azulite.train raises): the attempt was recorded
    as preempted (exit 75) and requeued outside max_retries; "preempted" must mean committed."""
    failing = PREEMPTIBLE.replace("sys.exit(75)", "sys.exit(1 if rank == 1 else 75)  # rank 1's save failed")
    rec, _ = _preempted_once(tmp_path / "pf", failing)
    assert rec.state == JobState.FAILED and rec.exit_code == 1, (rec.state, rec.reason)  # max_retries 0
    assert "rank 1" in rec.reason and "after the preempt request" in rec.reason, rec.reason
    assert [(a.attempt, a.exit_code) for a in rec.attempts] == [(1, 1)]


def test_preempt_requeues_and_the_next_attempt_succeeds(home, tmp_path):
    rec, state = _preempted_once(tmp_path / "pre", PREEMPTIBLE)
    assert rec.state == JobState.SUCCEEDED, rec.reason
    assert rec.attempt == 2
    assert [(a.attempt, a.state) for a in rec.attempts] == [(1, "requeued"), (2, "succeeded")]
    states = [e["state"] for e in rec.events]
    assert states[states.index("preempted") - 1 :][:4] == ["running", "preempted", "requeued", "running"]
    assert (state / "committed-0").exists() and (state / "committed-1").exists()
    first = {p.rank: p.exit_code for p in rec.processes if p.kind == "rank" and p.attempt == 1}
    assert first == {0: 75, 1: 75}
    assert "resumed in attempt 2" in Path(rec.job_dir, "attempt-2", "logs", "rank-0.log").read_text()


# A rank deaf to the preemption notice: it ignores SIGTERM and never commits (attempt 2 finishes at once).
DEAF_TO_SIGTERM = """
import os, signal, sys, time
if os.environ["AZULITE_ATTEMPT"] != "1":
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(f"started-{os.environ['RANK']}", "w").close()
time.sleep(300)
"""


def test_a_preempted_attempt_whose_ranks_were_killed_at_the_grace_is_requeued_not_succeeded(home, tmp_path):
    # torchrun gives its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT to end after the SIGTERM, then kills them: the
    # rank runners die before recording an exit code. No rank finished, so this attempt did not. (torchrun
    # itself exits 1 here; a launcher that exits 0 on SIGTERM is the case test_finished_... pins down.)
    spec = write_job(tmp_path / "deaf", DEAF_TO_SIGTERM, spec_2x1(
        extra="environment_variables:\n      TORCH_ELASTIC_SHUTDOWN_TIMEOUT: '1'", nodes=1, per_node=2))
    b = backend()
    rec = b.submit(load_job(spec))
    node = Path(rec.job_dir) / "nodes" / "node-0"
    wait_for(lambda: (node / "started-0").exists() and (node / "started-1").exists(), 120, "ranks to start")
    b.preempt(rec.id)
    rec = wait_done(rec.id)
    first = {p.rank: p.exit_code for p in rec.processes if p.kind == "rank" and p.attempt == 1}
    assert first == {0: None, 1: None}, first  # killed, never finished
    assert rec.state == JobState.SUCCEEDED, rec.reason
    assert [(a.attempt, a.state) for a in rec.attempts] == [(1, "requeued"), (2, "succeeded")], rec.attempts


def test_finished_needs_every_rank_done_and_a_preempted_rank_without_an_exit_code_is_not(tmp_path):
    from azulite.launch.local.strategy import RankResult
    from azulite.launch.local.supervisor import AttemptOutcome, finished

    def attempt(agents, ranks, preempt_asked=False):
        return AttemptOutcome(exits=dict(agents), preempt_asked=preempt_asked,
                              results=[RankResult(rank=r, node=0, local_rank=r, exit_code=c) for r, c in enumerate(ranks)])

    assert finished(attempt({"node-0": 0}, [0, 0]))
    assert finished(attempt({"node-0": 0}, [0, 0], preempt_asked=True))  # the preemption came too late to matter
    assert finished(attempt({"node-0": 0}, [0, None]))  # a rank that never started (a smaller elastic world)
    # the launcher's own exit 0 on SIGTERM, its ranks killed at the grace before recording an exit code
    assert not finished(attempt({"node-0": 0}, [None, None], preempt_asked=True))
    assert not finished(attempt({"node-0": 0}, [0, None], preempt_asked=True))
    assert not finished(attempt({"node-0": 1}, [0, 0]))
    assert not finished(attempt({"node-0": 0}, [0, 75]))


def test_a_rank_exiting_75_by_itself_requeues(home, tmp_path):
    script = "import os, sys\nsys.exit(75 if os.environ['AZULITE_ATTEMPT'] == '1' else 0)\n"
    spec = write_job(tmp_path / "p75", script, spec_2x1(nodes=1, per_node=2))
    rec = wait_done(backend().submit(load_job(spec)).id)
    assert rec.state == JobState.SUCCEEDED and rec.attempt == 2, rec.reason


# Rank 0 says "preempted" (75) and rank 1 crashes by itself (3), each on its own: rank 0 ignores the SIGTERM
# torchrun sends when the other rank ends and exits 75 only once rank 1's command has ended; rank 1 exits
# only once rank 0 is set. (Exiting at once, whichever rank torchrun saw end first had it stop the other
# before its own exit: under load rank 1 was stopped before it started, and the job was rightly requeued.)
REAL_FAILURE_BESIDE_A_75 = """
import os, signal, sys, time
from pathlib import Path

marks = Path(__file__).resolve().parent


def wait_for(ready):
    while not ready():
        time.sleep(0.01)  # polling a condition the other rank sets


def ended(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


if os.environ["RANK"] == "0":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (marks / "rank0-ready").touch()
    wait_for((marks / "rank1-pid").exists)
    pid = int((marks / "rank1-pid").read_text())
    wait_for(lambda: ended(pid))
    sys.exit(75)
wait_for((marks / "rank0-ready").exists)
(marks / "rank1-pid.tmp").write_text(str(os.getpid()))
os.replace(marks / "rank1-pid.tmp", marks / "rank1-pid")
sys.exit(3)
"""


def test_a_real_failure_beside_a_75_is_a_failure_not_a_preemption(home, tmp_path):
    # retrying a crash beside a preempted rank as a preemption would hide the crash
    script = REAL_FAILURE_BESIDE_A_75
    spec = write_job(tmp_path / "mix", script, spec_2x1(nodes=1, per_node=2))
    rec = wait_done(backend().submit(load_job(spec)).id)
    assert (rec.state, rec.exit_code, rec.failed_rank, rec.attempt) == (JobState.FAILED, 3, 1, 1), rec.reason
    assert sorted((p.rank, p.exit_code) for p in rec.processes if p.kind == "rank") == [(0, 75), (1, 3)]


def test_a_job_preempted_too_often_fails_instead_of_requeuing_forever(home, tmp_path, monkeypatch):
    monkeypatch.setenv("AZULITE_MAX_PREEMPTIONS", "2")
    spec = write_job(tmp_path / "always75", "import sys\nsys.exit(75)\n", spec_2x1(nodes=1, per_node=1))
    rec = wait_done(backend().submit(load_job(spec)).id)
    assert (rec.state, rec.exit_code, rec.attempt) == (JobState.FAILED, 75, 3), rec.reason
    assert "AZULITE_MAX_PREEMPTIONS=2" in rec.reason


def test_a_pinned_port_is_free_again_while_its_last_connections_linger_in_time_wait(home):
    with socket.socket() as srv:  # a server that closes first leaves its side in TIME_WAIT, as torchrun's store
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        cli = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        assert port_in_use(port)
    conn.close()
    time.sleep(0.1)
    cli.close()
    assert not port_in_use(port)


def test_port_in_use_is_refused_before_anything_starts(home, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        spec = write_job(tmp_path / "port", "print('x')\n",
                         spec_2x1(extra=f"environment_variables:\n      MASTER_PORT: {port}"))
        b = backend()
        with pytest.raises(LaunchError) as e:
            b.submit(load_job(spec))
    assert str(port) in e.value.message and "in use" in e.value.message
    assert e.value.where == "environment_variables.MASTER_PORT" and e.value.fix
    assert b.list() == []  # nothing recorded, nothing started


def test_job_outlives_the_submitting_process(home, tmp_path):
    """Submit from a child process that exits at once; the job still runs to success."""
    spec = write_job(tmp_path / "ok", "import os; print('rank', os.environ['RANK'])\n", spec_2x1())
    code = (
        "import json, sys; from azulite.launch.backend import get_backend; from azulite.launch.settings import Settings;"
        "from azulite.spec.loader import load_job;"
        f"r = get_backend('local', Settings.from_environ()).submit(load_job({str(spec)!r})); print(r.id)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    job_id = out.stdout.strip().splitlines()[-1]
    rec = wait_done(job_id)
    assert rec.state == JobState.SUCCEEDED, rec.reason
    assert {p.rank for p in rec.processes if p.kind == "rank"} == {0, 1}
    assert json.dumps(rec.to_json())  # serializable for --json


ELASTIC = """
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
marker = os.environ["CRASH_MARKER"]
if dist.get_rank() == 1 and not os.path.exists(marker):
    open(marker, "w").close()
    print("rank 1 crashes on the first try", flush=True)
    os._exit(1)
dist.barrier()
print(f"rank {dist.get_rank()} done after {restart} restart(s)", flush=True)
dist.destroy_process_group()
"""


def test_max_restarts_reaches_the_elastic_agent(home, tmp_path):
    marker = tmp_path / "crashed-once"
    spec = write_job(tmp_path / "el", ELASTIC,
                     spec_2x1(extra=f"max_restarts: 2\n    environment_variables:\n      CRASH_MARKER: {marker}"))
    rec = wait_done(backend().submit(load_job(spec)).id)
    assert rec.state == JobState.SUCCEEDED, rec.reason
    assert rec.attempt == 1  # restarted inside the attempt by torchrun, not requeued
    ranks = {p.rank: p for p in rec.processes if p.kind == "rank"}
    assert all(p.exit_code == 0 for p in ranks.values()), ranks
    # the failing node's agent counts a restart; its peer re-joins the new rendezvous (a membership change)
    assert max(p.restarts for p in ranks.values()) == 1, ranks
    logs = {r: Path(p.log).read_text() for r, p in ranks.items()}
    assert "crashes on the first try" in logs[1]  # one log per rank across restarts
    assert all("done after" in text for text in logs.values())
    assert marker.exists()


def test_timeout_fails_the_job_and_stops_it(home, tmp_path):
    spec = write_job(tmp_path / "to", SLEEPER, spec_2x1(extra="timeout: 3s", nodes=1, per_node=2))
    rec = wait_done(backend().submit(load_job(spec)).id, timeout=120)
    assert rec.state == JobState.FAILED and rec.exit_code == 124 and "timed out" in rec.reason
    wait_for(lambda: not job_procs({rec.id}), 20, "job processes to end")


def test_a_dead_supervisor_is_noticed_and_its_job_cleaned_up(home, tmp_path):
    spec = write_job(tmp_path / "sd", SLEEPER, spec_2x1(nodes=1, per_node=2))
    b = backend()
    rec = b.submit(load_job(spec))
    job_dir = Path(rec.job_dir)
    wait_for(lambda: (job_dir / "nodes/node-0/started-0").exists() and (job_dir / "nodes/node-0/started-1").exists(),
             120, "ranks to start")
    psutil.Process(b.status(rec.id).supervisor_pid).kill()
    rec = wait_for(lambda: (r := b.status(rec.id)).state.terminal and r, 30, "the job to be marked failed")
    assert rec.state == JobState.FAILED and "supervisor died" in rec.reason
    # the reason sent the reader to supervisor.log even when the kill left it empty
    said = (job_dir / "supervisor.log").exists() and (job_dir / "supervisor.log").stat().st_size > 0
    assert ("see " in rec.reason) == said and ("without a word" in rec.reason) == (not said), rec.reason
    assert not job_procs({rec.id})


SLEEP_THEN_FINISH = """
import os, sys, time
if os.environ["AZULITE_ATTEMPT"] != "1":
    sys.exit(0)
open(f"started-{os.environ['RANK']}", "w").close()
time.sleep(300)
"""


def test_a_dead_supervisor_is_requeued_under_a_new_one_within_max_retries(home, tmp_path):
    spec = write_job(tmp_path / "sr", SLEEP_THEN_FINISH, spec_2x1(extra="max_retries: 1", nodes=1, per_node=2))
    b = backend()
    rec = b.submit(load_job(spec))
    job_dir = Path(rec.job_dir)
    wait_for(lambda: (job_dir / "nodes/node-0/started-0").exists() and (job_dir / "nodes/node-0/started-1").exists(),
             120, "ranks to start")
    first = b.status(rec.id).supervisor_pid
    ranks = [p.pid for p in b.status(rec.id).processes if p.kind == "rank" and p.pid]
    psutil.Process(first).kill()
    # any command that looks (here: list) notices, ends the orphaned attempt and starts a new supervisor
    wait_for(lambda: b.list() and b.status(rec.id).attempt == 2, 60, "attempt 2")
    rec = wait_done(rec.id)
    assert rec.state == JobState.SUCCEEDED, rec.reason
    assert [(a.attempt, a.state) for a in rec.attempts] == [(1, "requeued"), (2, "succeeded")]
    assert "supervisor died" in rec.attempts[0].reason and "retry 1/1" in rec.attempts[0].reason
    assert rec.supervisor_pid != first
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in ranks)


SHRINKS = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"rank {dist.get_rank()} of {dist.get_world_size()} (restart {restart})", flush=True)
if restart == 0:
    open(f"started-{dist.get_rank()}", "w").close()
    while True:  # until a node is lost: then this collective fails and torchrun re-forms the group
        dist.all_reduce(torch.ones(1))
        time.sleep(0.05)
print(f"continued on world size {dist.get_world_size()}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("lost", ["node", "agent"])
def test_an_elastic_job_that_loses_a_node_goes_on_with_the_nodes_left(home, tmp_path, monkeypatch, lost):
    """``lost``: the whole node (agent and ranks) is killed, or its torchrun agent alone: the supervisor then
    ends the agent's ranks as a lost node's (left running, the orphan went on alone and held the survivor in
    torchrun's exit barrier for 300 s)."""
    monkeypatch.setenv("AZULITE_NODE_RETURN_S", "-1")  # the node stays lost (test_local_elastic: it returns)
    spec = write_job(tmp_path / "shrink", SHRINKS, spec_2x1(extra="max_restarts: 2\n    elastic: {min_nodes: 1}"))
    b = backend()
    rec = b.submit(load_job(spec))
    job_dir = Path(rec.job_dir)
    wait_for(lambda: (job_dir / "nodes/node-0/started-0").exists() or (job_dir / "nodes/node-0/started-1").exists(),
             120, "node 0's rank to start")
    wait_for(lambda: list((job_dir / "nodes/node-1").glob("started-*")), 120, "node 1's rank to start")
    agent = next(p for p in b.status(rec.id).processes if p.kind == "agent" and p.name == "node-1")
    node = psutil.Process(agent.pid)
    for p in [node, *(node.children(recursive=True) if lost == "node" else [])]:
        p.kill()
    rec = wait_done(rec.id, timeout=400)
    assert rec.state == JobState.SUCCEEDED and "elastic" in rec.reason, rec.reason
    assert rec.attempt == 1  # re-formed inside the attempt, not requeued
    logs = "\n".join(Path(p.log).read_text() for p in rec.processes if p.kind == "rank" and p.log and Path(p.log).exists())
    assert "continued on world size 1" in logs, logs[-3000:]
    assert any("node-1 lost" in e["message"] for e in rec.events)
    if lost == "agent":
        assert any("node-1's agent exited 137: its rank(s) [" in e["message"] and "ended with it" in e["message"]
                   for e in rec.events), rec.events
    assert not job_procs({rec.id})


def test_a_fixed_size_job_whose_agent_is_killed_fails_naming_the_lost_node(home, tmp_path):
    """kill -9 of one node's torchrun agent: its peers are stopped and exit 75, which was read as a preemption
    (requeued, max_retries bypassed up to AZULITE_MAX_PREEMPTIONS times, the 137 hidden). It is the failure
    of that node, retried as max_retries says (0 here), and its orphaned rank ends with it."""
    spec = write_job(tmp_path / "lost", SHRINKS, spec_2x1())
    b = backend()
    rec = b.submit(load_job(spec))
    job_dir = Path(rec.job_dir)
    wait_for(lambda: list((job_dir / "nodes/node-0").glob("started-*")) and list((job_dir / "nodes/node-1").glob("started-*")),
             120, "both nodes' ranks to start")
    agent = next(p for p in b.status(rec.id).processes if p.kind == "agent" and p.name == "node-1")
    psutil.Process(agent.pid).kill()
    rec = wait_done(rec.id, timeout=400)
    assert rec.state == JobState.FAILED and rec.attempt == 1, (rec.state, rec.reason, rec.attempts)
    assert rec.exit_code == 137 and "node-1's agent exited 137 (SIGKILL): the node was lost" in rec.reason, rec.reason
    assert not job_procs({rec.id})


def test_elastic_ranges_are_validated_and_reach_torchrun(tmp_path):
    from azulite.errors import SpecError
    from azulite.launch.local.strategy import get_strategy
    from azulite.launch.local.context import build_context

    spec = write_job(tmp_path / "r", "print(1)\n", spec_2x1(extra="elastic: {min_nodes: 1}"))
    job = load_job(spec)
    assert job.node_range == (1, 2)
    (tmp_path / "jd" / "code").mkdir(parents=True)
    ctx = build_context("r-1", 1, job, tmp_path / "jd", {"PATH": "/usr/bin"}, python="/venv/bin/python")
    procs = get_strategy("pytorch").processes(ctx)
    assert all("--nnodes=1:2" in p.argv for p in procs)
    # elastic rounds drop a lost node after 6 s of missed heartbeats and close 3 s after min_nodes joined
    conf = [next(a for a in p.argv if a.startswith("--rdzv-conf=")) for p in procs]
    assert conf == [f"--rdzv-conf=is_host={h},last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=3"
                    for h in (1, 0)], conf
    fixed = build_context("f-1", 1, load_job(write_job(tmp_path / "f", "print(1)\n", spec_2x1())), tmp_path / "jd",
                          {"PATH": "/usr/bin"}, python="/venv/bin/python")
    assert [a for p in get_strategy("pytorch").processes(fixed) for a in p.argv if a.startswith("--rdzv-conf=")] == \
        ["--rdzv-conf=is_host=1", "--rdzv-conf=is_host=0"]
    bad = write_job(tmp_path / "b", "print(1)\n", spec_2x1(extra="elastic: {min_nodes: 3}"))
    with pytest.raises(SpecError, match="min_nodes"):
        load_job(bad)


# Rank 1 fails on an error no restart can fix (exit 78, EX_CONFIG: what azulite.train.exit_code gives a bad URI
# or missing credentials); rank 0 waits to be stopped. Each run of rank 1 leaves a line in RUNS.
CONFIG_ERROR = """
import os, sys, time
from pathlib import Path
if os.environ["RANK"] == "1":
    with open(os.environ["RUNS"], "a") as f:
        f.write("run\\n")
    print("error: az://ckpt/x: no Azure Storage credentials", flush=True)
    sys.exit(78)
while True:
    time.sleep(0.1)
"""


def test_a_rank_exiting_78_fails_the_job_at_once_with_no_restart_and_no_retry(home, tmp_path):
    runs = tmp_path / "runs"
    spec = write_job(tmp_path / "cfg", CONFIG_ERROR, spec_2x1(
        extra=f"max_restarts: 2\n    max_retries: 2\n    environment_variables:\n      RUNS: {runs}", nodes=1, per_node=2))
    rec = wait_done(backend().submit(load_job(spec)).id)
    assert (rec.state, rec.exit_code, rec.failed_rank) == (JobState.FAILED, 78, 1), rec.reason
    assert rec.attempt == 1 and len(rec.attempts) == 1, rec.attempts  # not retried (max_retries: 2)
    assert "exited 78" in rec.reason and "not retried" in rec.reason
    assert any("exited 78 (an error no restart can fix): stopping node-0" in e["message"] for e in rec.events), rec.events
    # torchrun's max_restarts (2) would have run rank 1 three times; the supervisor stops the agent as soon as
    # the first run's exit is recorded, long before a restarted rank could get that far again
    assert len(runs.read_text().splitlines()) < 3
    log = Path(next(p.log for p in rec.processes if p.kind == "rank" and p.rank == 1)).read_text()
    assert "no Azure Storage credentials" in log
    assert not job_procs({rec.id})


def test_max_retries_starts_a_new_attempt_after_a_failure(home, tmp_path):
    script = "import os, sys\nsys.exit(4 if os.environ['AZULITE_ATTEMPT'] == '1' else 0)\n"
    spec = write_job(tmp_path / "retry", script, spec_2x1(extra="max_retries: 1", nodes=1, per_node=2))
    rec = wait_done(backend().submit(load_job(spec)).id)
    assert rec.state == JobState.SUCCEEDED and rec.attempt == 2, rec.reason
    assert rec.attempts[0].state == "requeued" and rec.attempts[0].exit_code == 4
    assert "retry 1/1" in rec.attempts[0].reason
