"""The tensorflow strategy end to end (real supervisor, real processes): the exact TF_CONFIG each worker
and parameter server sees, ps processes ended once the workers are done, a failing worker, and cancel of
a real TF worker blocked waiting for its peer (SIGKILL fallback) leaving no process behind.

Only the last test imports TensorFlow (slow); the others run plain Python scripts that print what they
were given, which is all the strategy is responsible for."""

import importlib.util
import json
import re
import shutil
from pathlib import Path

import psutil
import pytest

from azulite.launch.records import JobState
from azulite.spec.loader import load_job
from tests.launch.jobkit import REPO, backend, home, job_procs, wait_done, wait_for, write_job

pytestmark = pytest.mark.slow
_ = home  # fixture

# Each task prints its TF_CONFIG. A ps listens on its own address, ignores SIGTERM and serves forever (as a
# TF server in join() may), so only the guard's SIGKILL ends it; workers reach the ps at the address their
# TF_CONFIG names (retrying while it starts) and end.
TF_CONFIG_PRINTER = """
import json, os, signal, socket, time
cfg = json.loads(os.environ["TF_CONFIG"])
print("tf_config=" + json.dumps(cfg), flush=True)
print("cwd=" + os.getcwd(), flush=True)
host, port = cfg["cluster"]["ps"][0].rsplit(":", 1)
if cfg["task"]["type"] == "ps":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = socket.create_server((host, int(port)))
    while True:
        server.accept()[0].close()
deadline = time.monotonic() + 90
while True:
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
print("reached ps", flush=True)
"""

# Worker 1 fails; worker 0 waits for its peer forever and ignores SIGTERM, as a TF worker in a collective.
FAILING_WORKER = """
import json, os, signal, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
if index == 1:
    print("worker 1: broken", flush=True)
    sys.exit(3)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("worker 0: waiting for peer", flush=True)
time.sleep(300)
"""


def _tf_spec(workers: int, ps: int, nodes: int) -> str:
    return f"""
    name: tf
    code: .
    command: python run.py
    instance_count: {nodes}
    distribution:
      type: tensorflow
      worker_count: {workers}
      parameter_server_count: {ps}
    """


def _tf_config(log: Path) -> dict:
    return json.loads(re.search(r"^tf_config=(.*)$", log.read_text(), re.M).group(1))


def test_each_worker_and_ps_sees_exactly_its_tf_config(home, tmp_path):
    spec = write_job(tmp_path / "cfg", TF_CONFIG_PRINTER, _tf_spec(workers=2, ps=1, nodes=2))
    rec = backend().submit(load_job(spec))
    rec = wait_done(rec.id, timeout=120)
    assert rec.state == JobState.SUCCEEDED, rec.reason  # the ps ignoring SIGTERM did not hold the job open
    ranks = sorted((p for p in rec.processes if p.kind == "rank"), key=lambda p: p.rank)
    assert [(p.rank, p.node, p.local_rank, p.exit_code) for p in ranks] == [(0, 0, 0, 0), (1, 1, 0, 0)]

    cfgs = {p.rank: _tf_config(Path(p.log)) for p in ranks}
    workers = cfgs[0]["cluster"]["worker"]
    ps = cfgs[0]["cluster"]["ps"]
    assert len(workers) == 2 and len(ps) == 1 and len(set(workers + ps)) == 3
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in workers + ps)
    for i in (0, 1):
        assert cfgs[i] == {"cluster": {"worker": workers, "ps": ps}, "task": {"type": "worker", "index": i},
                           "environment": "cloud"}
    job_dir = Path(rec.job_dir)
    ps_log = job_dir / "attempt-1" / "logs" / "ps-0.log"
    assert _tf_config(ps_log) == {"cluster": {"worker": workers, "ps": ps}, "task": {"type": "ps", "index": 0},
                                  "environment": "cloud"}
    assert "all 2 worker(s) ended; stopping parameter server" in ps_log.read_text()
    # worker i runs on simulated node i % instance_count, in that node's working directory
    for p in ranks:
        assert f"cwd={job_dir / 'nodes' / f'node-{p.node}'}" in Path(p.log).read_text()
        assert "reached ps" in Path(p.log).read_text()
    agents = {p.name: p.exit_code for p in rec.processes if p.kind == "agent"}
    assert agents == {"ps-0": 0, "worker-0": 0, "worker-1": 0}
    assert not job_procs({rec.id})
    # past the workers, --rank reaches the parameter servers, as on the kubernetes backend (it was "no rank 2")
    assert list(backend().logs(rec.id, rank=2)) == ps_log.read_text().splitlines()
    every = list(backend().logs(rec.id))
    assert every[-1] == "[ps 0] azulite: all 2 worker(s) ended; stopping parameter server"
    assert any(line.startswith("[rank 1] tf_config=") for line in every)


def test_job_logs_rank_past_the_workers_is_a_parameter_server_and_beyond_them_an_error(home, tmp_path, capsys):
    from tests.cli.inprocess import exit_code

    rec = wait_done(backend().submit(load_job(write_job(tmp_path / "cfg", TF_CONFIG_PRINTER,
                                                        _tf_spec(workers=2, ps=1, nodes=1)))).id, timeout=120)
    assert exit_code("job", "logs", rec.id, "--rank", "2") == 0
    assert '"task": {"type": "ps", "index": 0}' in capsys.readouterr().out
    assert exit_code("job", "logs", rec.id, "--rank", "3") == 2
    assert "its ranks are 0, 1 (workers) and 2 (parameter servers)" in capsys.readouterr().err


# Preemptible workers (a notice: exit 75) beside a ps that ignores SIGTERM and serves forever.
PREEMPTIBLE_WITH_PS = """
import json, os, signal, sys, time
cfg = json.loads(os.environ["TF_CONFIG"])
me = f"{cfg['task']['type']}-{cfg['task']['index']}"
if int(os.environ["AZULITE_ATTEMPT"]) > 1:
    sys.exit(0)
stop = []
signal.signal(signal.SIGTERM, signal.SIG_IGN if me.startswith("ps") else lambda *_: stop.append(1))
open(os.path.join(os.environ["AZULITE_OUTPUT_STATE"], f"started-{me}"), "w").close()
while not stop:
    time.sleep(0.05)
sys.exit(75)
"""


def test_a_preempted_jobs_ps_that_ignores_the_stop_is_ended_by_its_guard_once_the_workers_are(home, tmp_path):
    """The stop reaches the ps's group (its guard and the ps), once; the guard passes nothing on and, as
    at a normal end, ends the ps when both workers have ended (exit 0), not the preempt grace's SIGKILL."""
    spec = write_job(tmp_path / "pre", PREEMPTIBLE_WITH_PS, _tf_spec(workers=2, ps=1, nodes=1)
                     + "outputs:\n      state:\n        type: uri_folder\n        path: state\n")
    state = tmp_path / "pre" / "state"
    b = backend()
    rec = b.submit(load_job(spec))
    wait_for(lambda: len(list(state.glob("started-*"))) == 3 or b.status(rec.id).state.terminal, 120, "all tasks up")
    b.preempt(rec.id)
    rec = wait_done(rec.id)
    assert [(a.attempt, a.state) for a in rec.attempts] == [(1, "requeued"), (2, "succeeded")], rec.reason
    first = {p.name: p.exit_code for p in rec.processes if p.kind == "agent" and p.attempt == 1}
    assert first == {"ps-0": 0, "worker-0": 75, "worker-1": 75}, first
    ps_log = Path(rec.job_dir) / "attempt-1" / "logs" / "ps-0.log"
    assert "all 2 worker(s) ended; stopping parameter server" in ps_log.read_text()


def test_failing_worker_fails_the_job_and_its_waiting_peer_is_killed(home, tmp_path):
    spec = write_job(tmp_path / "fail", FAILING_WORKER, _tf_spec(workers=2, ps=0, nodes=1))
    rec = wait_done(backend().submit(load_job(spec)).id, timeout=120)
    assert rec.state == JobState.FAILED
    assert rec.exit_code == 3 and rec.failed_rank == 1, rec.reason
    ranks = {p.rank: p for p in rec.processes if p.kind == "rank"}
    assert ranks[1].exit_code == 3
    assert ranks[0].exit_code != 0  # SIGTERM ignored: ended by the SIGKILL fallback
    assert not job_procs({rec.id})


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow-cpu not installed")
def test_cancel_of_a_tf_worker_waiting_for_its_peer_leaves_no_process(home, tmp_path):
    """Worker 0 is real TensorFlow (MultiWorkerMirroredStrategy) and blocks for worker 1, which never
    joins. Cancel must end everything: TF may not react to SIGTERM there, the tree kill's SIGKILL does."""
    d = tmp_path / "tfcancel"
    d.mkdir()
    shutil.copy(REPO / "examples" / "tensorflow" / "train.py", d / "train.py")
    (d / "job.yaml").write_text(
        "name: tfc\ncode: .\n"
        "command: 'if [ \"$AZULITE_RANK\" = 1 ]; then exec sleep 300; else exec python train.py; fi'\n"
        "distribution: {type: tensorflow, worker_count: 2}\n"
    )
    b = backend()
    rec = b.submit(load_job(d / "job.yaml"))
    port = None

    def worker0_listening():
        nonlocal port
        log = Path(rec.job_dir) / "attempt-1" / "logs" / "rank-0.log"
        if port is None:
            m = log.exists() and re.search(r"^tf_config=(.*)$", log.read_text(), re.M)
            if not m:
                return False
            port = int(json.loads(m.group(1))["cluster"]["worker"][0].rsplit(":", 1)[1])
        # TF's gRPC server of worker 0 is up: it is inside the strategy, waiting for worker 1
        return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                   for c in psutil.net_connections("tcp"))

    wait_for(lambda: worker0_listening() or b.status(rec.id).state.terminal, 120, "TF worker 0 to listen")
    assert b.status(rec.id).state == JobState.RUNNING
    before = job_procs({rec.id})
    assert len(before) >= 4, [p.cmdline() for p in before]  # 2 rank runners + TF worker + sleep
    rec = b.cancel(rec.id)
    assert rec.state == JobState.CANCELED
    wait_for(lambda: not job_procs({rec.id}), 20, "all job processes to end")
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in before)

