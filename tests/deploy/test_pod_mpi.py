"""pod_mpi.py as an MPIJob's pods run it, with real Open MPI over real sshd: each "worker pod" is the worker
agent around its own sshd on a loopback address of its own (127.0.0.2, 127.0.0.3: Open MPI takes them for
other hosts and reaches them through ssh, as mpirun reaches the operator's workers), the launcher agent runs
mpirun with the operator's hostfile variable, and the ranks run under the rank runner. Checked: a success;
an eviction of one worker (every rank gets exactly one SIGTERM, each exits 75, the slower one is not killed
for the first one's exit, and the launcher runs mpirun again once the worker is back); a stop of the
launcher; a 78; a worker that is not up yet; the board's rules on raw sockets."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from azulite.deploy import pod_entry, pod_mpi
from azulite.launch.local import mpi as local_mpi
from tests.deploy.mpi_cluster import POD_MPI, SSHD, Cluster, kill_tree
from tests.launch.jobkit import wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI (mpirun) not installed"),
    pytest.mark.skipif(not os.access(SSHD, os.X_OK) or shutil.which("ssh") is None,
                       reason="OpenSSH server/client not installed (scripts/install.sh --dev installs them)"),
]

# A rank: records what it sees, then (mode "wait") waits for a stop and counts the SIGTERMs delivered to it
# through the wakeup fd (one byte per delivery; the Python-level handler merges close ones), keeps counting
# for 0.5 + 3 * rank seconds (room for a duplicate to land; and the ranks end apart, further than Open MPI
# takes to kill the ranks left when one exits (~2 s measured), which is the hold's case),
# "commits" and exits 75. A run after a preemption (run >= 1) ends at once.
RANK = """
import json, os, signal, sys, time
from pathlib import Path
e = os.environ
rank, out, mode = int(e["AZULITE_RANK"]), Path(sys.argv[1]), sys.argv[2]
run = len(list(out.glob(f"started-{rank}-*")))
r, w = os.pipe()
os.set_blocking(w, False)
signal.set_wakeup_fd(w, warn_on_full_buffer=False)
signal.signal(signal.SIGTERM, lambda *_: None)
seen = {k: e.get(k) for k in ("AZULITE_NODE_RANK", "AZULITE_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "FORWARDED",
                              "AZULITE_POD_MARKS")}
(out / f"started-{rank}-{run}").write_text(json.dumps(seen))
if mode == "ok" or run >= 1:
    sys.exit(0)
if mode == "config" and rank == 1:
    sys.exit(78)
got = os.read(r, 64)
t = time.monotonic()
while time.monotonic() - t < 0.5 + 3 * rank:
    time.sleep(0.02)
os.set_blocking(r, False)
try:
    got += os.read(r, 64)
except BlockingIOError:
    pass
(out / f"sigterms-{rank}-{run}").write_text(str(got.count(signal.SIGTERM)))
(out / f"committed-{rank}-{run}").write_text("")
sys.exit(75)
"""


class RankCluster(Cluster):
    """Two workers of one slot, running RANK."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        (tmp / "out").mkdir()
        (tmp / "rank.py").write_text(RANK)

    def mpirun(self, mode: str) -> list[str]:
        return ["mpirun", "--allow-run-as-root", "-np", "2", "--map-by", "slot", "--bind-to", "none",
                "-x", pod_mpi.ENV_BOARD, "-x", "FORWARDED", "-x", "PATH", "--wdir", str(self.tmp),
                sys.executable, POD_MPI, "rank", "--", sys.executable, "-u", "rank.py", str(self.tmp / "out"), mode]

    def start(self, mode: str, *opts: str) -> subprocess.Popen:
        argv = [sys.executable, POD_MPI, "launcher", "--ssh-port", str(self.port), "--wait-workers", "120", *opts,
                "--", *self.mpirun(mode)]
        return self.start_launcher(argv, self.launcher_env(FORWARDED="from-the-launcher"), self.tmp)

    def out(self, name: str) -> str | None:
        path = self.tmp / "out" / name
        return path.read_text() if path.exists() else None


@pytest.fixture
def cluster(tmp_path):
    c = RankCluster(tmp_path)
    yield c
    c.close()


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"did not end:\n{out}") from None
    return proc.returncode, out


def test_a_job_runs_over_ssh_with_the_launchers_environment_and_each_nodes_identity(cluster):
    for i in (0, 1):
        cluster.start_worker(i)
    code, log = finish(cluster.start("ok"))
    assert code == 0, log
    seen = [json.loads(cluster.out(f"started-{r}-0") or "{}") for r in (0, 1)]
    assert [s["AZULITE_NODE_RANK"] for s in seen] == ["0", "1"], seen  # mpirun's NODE_RANK is 0 for both
    assert [s["AZULITE_LOCAL_RANK"] for s in seen] == ["0", "0"]
    assert all(s["FORWARDED"] == "from-the-launcher" and s["OMPI_COMM_WORLD_SIZE"] == "2" for s in seen)
    # each rank ran in its own worker (the marks folder its sshd gives it) and left no running record
    assert [s["AZULITE_POD_MARKS"] for s in seen] == [str(cluster.marks(0)), str(cluster.marks(1))]
    assert not list(cluster.marks(0).glob(f"{pod_mpi.RUNNING}*")) and not list(cluster.marks(1).glob(f"{pod_mpi.RUNNING}*"))


def test_an_evicted_worker_stops_every_rank_once_and_the_launcher_runs_again_when_it_is_back(cluster):
    for i in (0, 1):
        cluster.start_worker(i)
    launcher = cluster.start("wait")
    wait_for(lambda: all((cluster.marks(i) / f"{pod_mpi.RUNNING}{i}.json").exists() for i in (0, 1)), 120,
             "both ranks running")
    wait_for(lambda: cluster.out("started-0-0") and cluster.out("started-1-0"), 60, "both ranks' handlers")
    old = cluster.workers[1]
    old.send_signal(signal.SIGTERM)  # the kubelet's stop of an evicted pod
    code = old.wait(timeout=120)  # the agent's own end (its pipe stays open while the ranks under sshd run)
    # it ended only after its rank had committed (as PID 1 its end would have killed the rank)
    assert cluster.out("committed-1-0") is not None
    assert code == 128 + signal.SIGTERM  # not 0: restartPolicy OnFailure brings it back in place
    cluster.start_worker(1)  # the operator recreates the pod under the same name
    code, log = finish(launcher)
    assert code == 0, log
    # every rank got exactly one SIGTERM: rank 1 from its pod's agent, rank 0 through the board; rank 0
    # committed first and was not killed for it (its 75 held until rank 1 had ended too)
    assert (cluster.out("sigterms-0-0"), cluster.out("sigterms-1-0")) == ("1", "1"), log
    assert cluster.out("committed-0-0") is not None
    assert "rerun 1 of at most" in log and "mpirun exited" in log
    assert cluster.out("started-0-1") and cluster.out("started-1-1"), log  # the second run, on both workers


def test_a_signal_to_a_ranks_group_reaches_its_command_once_and_the_others_through_the_board(cluster):
    """As orted signals a rank (its process group): the command gets that one SIGTERM, its runner passes
    nothing on but tells the board, which stops the other rank; both checkpoint, and mpirun runs again."""
    for i in (0, 1):
        cluster.start_worker(i)
    launcher = cluster.start("wait")
    mark = cluster.marks(1) / f"{pod_mpi.RUNNING}1.json"
    wait_for(lambda: mark.exists() and cluster.out("started-0-0") and cluster.out("started-1-0"), 120,
             "both ranks' handlers")
    os.killpg(json.loads(mark.read_text())["pid"], signal.SIGTERM)
    code, log = finish(launcher)
    assert code == 0, log
    assert (cluster.out("sigterms-0-0"), cluster.out("sigterms-1-0")) == ("1", "1"), log
    assert "rerun 1 of at most" in log and cluster.out("started-1-1")
    assert "not every rank ended" not in log  # rank 1's 75 was released, not timed out: the board stopped rank 0


def test_a_stopped_launcher_stops_every_rank_once_and_exits_75_without_a_rerun(cluster):
    for i in (0, 1):
        cluster.start_worker(i)
    launcher = cluster.start("wait")
    wait_for(lambda: cluster.out("started-0-0") and cluster.out("started-1-0"), 120, "both ranks' handlers")
    launcher.send_signal(signal.SIGTERM)
    code, log = finish(launcher)
    assert code == pod_entry.EXIT_PREEMPTED, log
    assert (cluster.out("sigterms-0-0"), cluster.out("sigterms-1-0")) == ("1", "1"), log
    assert cluster.out("committed-0-0") is not None and cluster.out("committed-1-0") is not None
    assert cluster.out("started-0-1") is None and "rerun" not in log


def test_a_ranks_78_stops_the_others_and_the_launcher_exits_78(cluster):
    for i in (0, 1):
        cluster.start_worker(i)
    code, log = finish(cluster.start("config"))
    assert code == pod_entry.EXIT_CONFIG, log  # (rank 0 is stopped by the board, or by mpirun's abort)
    assert "rank 1 exited 78" in log and "rerun" not in log


def test_the_launcher_waits_for_a_worker_whose_sshd_is_not_up_yet(cluster):
    cluster.start_worker(0)
    wait_for(lambda: pod_mpi._answers(cluster.hosts[0], cluster.port), 60, "worker 0's sshd")
    launcher = cluster.start("ok")
    line = wait_for(lambda: launcher.stdout.readline(), 60, "the launcher's first line")  # type: ignore[union-attr]
    assert "waiting for the sshd of 127.0.0.3" in line, line
    cluster.start_worker(1)
    code, log = finish(launcher)
    assert code == 0, line + log


def test_without_workers_the_launcher_gives_up_naming_them(cluster):
    p = subprocess.run([sys.executable, POD_MPI, "launcher", "--ssh-port", str(cluster.port), "--wait-workers", "0",
                        "--", "true"], env=cluster.launcher_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert "no sshd answered on 127.0.0.2, 127.0.0.3" in p.stderr and "Dockerfile installs it" in p.stderr


class _Rank:
    """A raw connection to a board, as a rank runner makes it."""

    def __init__(self, board: pod_mpi.Board, rank: int, world: int = 2, token: str | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", board.port), timeout=30)
        self.lines = self.sock.makefile("r")
        self.token = board.token if token is None else token
        self.send(event="start", rank=rank, world=world)

    def send(self, **msg) -> None:
        self.sock.sendall((json.dumps({**msg, "token": self.token}) + "\n").encode())

    def read(self) -> str:
        return self.lines.readline().strip()


def test_the_board_stops_every_rank_once_and_releases_the_75s_when_all_have_ended():
    board = pod_mpi.Board()
    try:
        a, b = _Rank(board, 0), _Rank(board, 1)
        wait_for(lambda: len(board.conns) == 2, 30, "both ranks on the board")
        b.send(event="stopping")
        assert (a.read(), b.read()) == ("stop", "stop")
        a.send(event="end", code=75)
        wait_for(lambda: 0 in board.ends, 30, "rank 0's end")
        a.sock.settimeout(0)
        with pytest.raises(BlockingIOError):  # held: rank 1 has not ended
            a.sock.recv(1, socket.MSG_PEEK)
        a.sock.settimeout(30)
        b.send(event="end", code=75)
        assert a.read() == "release" and b.read() == "release"
        assert board.last() == [{"rank": 0, "code": 75}, {"rank": 1, "code": 75}]
        late = _Rank(board, 2)  # a rank that connects after the stop is told at once
        assert late.read() == "stop"
        stranger = _Rank(board, 3, token="not-the-token")
        assert stranger.read() == ""  # its connection is closed, nothing recorded
        garbled = _Rank(board, 4)
        garbled.send(event="end", code="x")
        assert (garbled.read(), garbled.read()) == ("stop", "")  # closed at a message that does not parse
        assert 3 not in board.conns and 4 not in board.ends
    finally:
        board.close(drain_s=0)


def test_a_78_on_the_board_stops_the_others():
    board = pod_mpi.Board()
    try:
        a, b = _Rank(board, 0), _Rank(board, 1)
        wait_for(lambda: len(board.conns) == 2, 30, "both ranks on the board")
        b.send(event="end", code=78)
        assert a.read() == "stop"
    finally:
        board.close(drain_s=0)


def test_its_constants_are_the_local_launchers():
    from azulite.launch.settings import Settings

    assert pod_mpi.PEER_HOLD_S == local_mpi.PEER_HOLD_S
    assert pod_mpi.MAX_RERUNS == Settings.max_preemptions


@pytest.mark.parametrize("args, words", [
    ([], "the first word is launcher, worker or rank"),
    (["launcher", "--ssh-port", "x", "--", "mpirun"], "--ssh-port takes a number"),
    (["launcher", "--max-reruns=-1", "--", "mpirun"], "--max-reruns takes a number >= 0"),
    (["worker", "--", ], "no command after '--'"),
    (["rank", "--", "true"], "run it under mpirun"),
])
def test_a_mangled_command_line_is_one_clear_line_and_exit_2(args, words):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_")}
    p = subprocess.run([sys.executable, POD_MPI, *args], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2 and words in p.stderr, p.stderr
