"""The pod entry of an MPIJob (kubeflow/mpi-operator, kubeflow.org/v2beta1): shipped beside ``pod_entry.py``
in the job's ConfigMap and, like it, the image's Python with its standard library only. Three roles:

``python3 pod_mpi.py launcher [--ssh-port N] [--wait-workers S] [--max-reruns N] -- mpirun ... \\
    python3 pod_mpi.py rank [--python] -- CMD...``  (the launcher pod)
``python3 pod_mpi.py worker -- /usr/sbin/sshd -De``  (each worker pod)

mpirun reaches the workers through their sshd, so a worker's ranks are sshd's descendants, with none of the
pod's environment and none of its signals; and Open MPI ends a job on a rank's non-zero exit (or on its own
SIGTERM) by killing every rank within a second (measured: docs/perf-launch.md "Stop 39"), which no
checkpoint survives. What makes a preemption end in a checkpoint on every rank:

- ``rank`` (what mpirun starts for each rank) runs the command in its own process group (orted gives each
  rank one; its abort reaches the command there), connects to the launcher's *board* (``AZULITE_POD_BOARD``, passed with ``mpirun -x``),
  and sends the command exactly one SIGTERM when the pod is stopped (SIGUSR1 from the worker) or the board
  says stop; it tells the board when it is stopped and how its command ended, and a 75 (checkpointed) waits
  until every rank has ended (at most ``PEER_HOLD_S``), or mpirun would kill the peers still committing.
- ``worker`` is PID 1 of a worker pod, around sshd. On the kubelet's SIGTERM (an eviction) it asks each rank
  running in the pod (its runner wrote ``mpi-running-<rank>.json`` in the marks folder) to stop, ends sshd's
  listener at once (no new session: whatever answers on the pod's name afterwards is its successor), and
  ends only once the ranks have: PID 1 ending ends the container, and every rank with it.
- ``launcher`` is PID 1 of the launcher pod, around mpirun. It waits until every worker in the operator's
  hostfile answers on its ssh port (a recreated worker may be pending for minutes), runs mpirun with a
  fresh board, passes a stop to every rank (the board, not mpirun: mpirun's SIGTERM kills them) and, when
  the ranks checkpointed after a preemption of any worker, runs mpirun again in the same pod (at most
  ``--max-reruns`` times; the operator's launcher Job would count each such exit against
  ``runPolicy.backoffLimit``, which is the job's ``max_retries`` for failures). Its exit code is the
  verdict of ``pod_entry.verdict`` over the ranks' ends: 78 if a rank exited 78, 75 when the ranks
  checkpointed after its own stop, else mpirun's code.

``tests/deploy/test_pod_mpi.py`` runs all three around real Open MPI over real sshd on loopback addresses.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

if __package__:  # imported from the package (the renderer, tests)
    from azulite.deploy import pod_entry as entry
else:  # run as a script, in the pod: the file beside this one (sys.path[0]), from the same ConfigMap
    import pod_entry as entry  # type: ignore[import-not-found, no-redef]

ENV_BOARD = "AZULITE_POD_BOARD"  # host:port:token of the launcher's board, for each rank (mpirun -x)
ENV_POD_IP = "AZULITE_POD_IP"  # the launcher pod's IP (downward API): where the ranks reach the board
ENV_HOSTFILE = "OMPI_MCA_orte_default_hostfile"  # the operator's hostfile, on the launcher
RUNNING = "mpi-running-"  # mpi-running-<rank>.json: a rank's runner, while its command runs
PEER_HOLD_S = 30.0  # azulite.launch.local.mpi.PEER_HOLD_S (a test keeps them equal)
MAX_RERUNS = 20  # AZULITE_MAX_PREEMPTIONS' default (azulite.launch.settings)
WAIT_WORKERS_S = 600.0
STOP_RANK = signal.SIGUSR1  # worker -> rank runner: the pod is being stopped
USAGE = ("usage: pod_mpi.py launcher [--ssh-port N] [--wait-workers S] [--max-reruns N] -- mpirun ...\n"
         "       pod_mpi.py worker [--marks DIR] -- SSHD...\n"
         "       pod_mpi.py rank [--python] -- CMD...")
say = entry.say


class Board:
    """The launcher's meeting point for one mpirun run: each rank's runner connects (a line of JSON per
    event, with the board's token), says when it is stopped and how its command ended. The board passes a
    stop to every rank once any is stopped or exits 78, and releases the ranks that exited 75 once every
    rank of the world has ended."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self.lock = threading.RLock()
        self.conns: dict[int, socket.socket] = {}
        self.ends: dict[int, int] = {}
        self.held: set[int] = set()
        self.world = 0
        self.stopped = False
        self.readers: list[threading.Thread] = []
        if socket.has_dualstack_ipv6():
            self.sock = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self.sock = socket.create_server(("", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def address(self, host: str) -> str:
        return f"{host}:{self.port}:{self.token}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            reader = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self.lock:
                self.readers.append(reader)
            reader.start()

    def _serve(self, conn: socket.socket) -> None:
        rank = None
        with conn, conn.makefile("r", encoding="utf-8") as lines:
            for line in lines:
                try:
                    msg = json.loads(line)
                    if not secrets.compare_digest(str(msg.get("token")), self.token):
                        return  # not one of this run's ranks
                    event = msg.get("event")
                    if event == "start":
                        rank, world = int(msg["rank"]), int(msg["world"])
                    code = int(msg.get("code", 1))
                except (ValueError, KeyError, TypeError, AttributeError):
                    return
                if rank is None:
                    return
                with self.lock:
                    if event == "start":
                        self.world = max(self.world, world)
                        self.conns[rank] = conn
                        if self.stopped:
                            self._send(conn, "stop")
                    elif event == "stopping":
                        self.stop()
                    elif event == "end":
                        self.ends[rank] = code
                        if code == entry.EXIT_CONFIG:
                            self.stop()
                        if code == entry.EXIT_PREEMPTED:
                            self.held.add(rank)
                        self._release_if_all_ended()

    @staticmethod
    def _send(conn: socket.socket, word: str) -> None:
        try:
            conn.sendall(f"{word}\n".encode())
        except OSError:  # that rank is gone: nothing to tell it
            pass

    def stop(self) -> bool:
        """Tell every rank still running to stop (once); False when no rank has connected yet."""
        with self.lock:
            if not self.stopped:
                self.stopped = True
                for rank, conn in self.conns.items():
                    if rank not in self.ends:
                        self._send(conn, "stop")
            return bool(self.conns)

    def _release_if_all_ended(self) -> None:
        if self.world and len(self.ends) >= self.world:
            for rank in sorted(self.held):
                self._send(self.conns[rank], "release")
            self.held.clear()

    def last(self) -> list[dict]:
        with self.lock:
            return [{"rank": r, "code": c} for r, c in sorted(self.ends.items())]

    def close(self, drain_s: float = 10.0) -> None:
        """Stop accepting, and read what the ranks sent to its end: a rank's last message may still be in
        flight when mpirun has exited (each connection ends when its rank process has)."""
        self.sock.close()
        deadline = time.monotonic() + drain_s
        with self.lock:
            readers = list(self.readers)
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))


def _hosts(path: str) -> list[str]:
    """The hosts of an Open MPI hostfile (``host slots=N`` lines; # comments)."""
    hosts = []
    with open(path) as f:
        for line in f:
            word = line.split("#", 1)[0].split()
            if word:
                hosts.append(word[0])
    return hosts


def _answers(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        return False
    return True


def wait_for_workers(hosts: list[str], port: int, wait_s: float, stopping: list) -> list[str]:
    """Wait until each host accepts a connection on ``port`` (its sshd); the hosts that did not within
    ``wait_s`` (or before a stop). A stopped worker's sshd stops listening at the stop (see ``worker``), so
    after a preempted run whatever answers is the recreated pod."""
    deadline = time.monotonic() + wait_s
    waiting = list(hosts)
    said = False
    while waiting and not stopping:
        waiting = [h for h in waiting if not _answers(h, port)]
        if not waiting or time.monotonic() >= deadline:
            break
        if not said:
            say(f"waiting for the sshd of {', '.join(waiting)} (port {port}) before mpirun")
            said = True
        time.sleep(1.0)
    return waiting


def _subreaper() -> None:
    """Be the reaper of the processes orphaned below this one, as PID 1 is in a pod: sshd's sessions after
    its listener ends, mpirun's daemons. (Linux's PR_SET_CHILD_SUBREAPER; a no-op as PID 1 and elsewhere.)"""
    if os.getpid() == 1 or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _int_option(opts: dict, name: str, default: float, kind: type = int) -> float:
    raw = str(opts.get(name, default))
    try:
        value = kind(raw)
    except ValueError:
        raise entry.UsageError(f"{name} takes a number, not {raw!r}") from None
    if value < 0:
        raise entry.UsageError(f"{name} takes a number >= 0, not {raw!r}")
    return value


def launcher(argv: list[str]) -> int:
    opts, cmd = entry._options(argv, (), ("--ssh-port", "--wait-workers", "--max-reruns"))
    port = int(_int_option(opts, "--ssh-port", 22))
    wait_s = _int_option(opts, "--wait-workers", WAIT_WORKERS_S, float)
    max_reruns = int(_int_option(opts, "--max-reruns", MAX_RERUNS))
    stopping: list[str] = []
    run: dict = {}  # the current run: its board and mpirun's pid

    def on_stop(signum, _frame):
        first = not stopping
        stopping.append(signal.Signals(signum).name)
        board, pid = run.get("board"), run.get("pid")
        if board is not None and board.stop():
            if first:
                say(f"{stopping[0]}: every rank is told to stop (checkpoint, then exit {entry.EXIT_PREEMPTED})")
        elif pid is not None:  # no rank has started: nothing to commit; mpirun ends its job itself
            try:
                os.killpg(pid, signum)
            except ProcessLookupError:
                pass

    for s in entry.STOPS:
        signal.signal(s, on_stop)
    _subreaper()
    try:
        ip = os.environ.get(ENV_POD_IP) or socket.gethostbyname(socket.gethostname())
    except OSError as e:
        say(f"cannot find this pod's address ({e}; {ENV_POD_IP} is unset): the ranks cannot reach its board")
        ip = "127.0.0.1"
    hostfile = os.environ.get(ENV_HOSTFILE)
    reruns = 0
    while True:
        if hostfile:
            try:
                missing = wait_for_workers(_hosts(hostfile), port, wait_s, stopping)
            except OSError as e:
                say(f"cannot read the hostfile {hostfile}: {e.strerror or e}")
                return 1
            if stopping:
                return 128 + signal.SIGTERM
            if missing:
                say(f"no sshd answered on {', '.join(missing)} port {port} within {wait_s:g}s: is the worker "
                    f"image's sshd installed (the rendered Dockerfile installs it) and the pod scheduled?")
                return 1
        board = Board()
        run["board"] = board
        try:
            proc = subprocess.Popen(cmd, env={**os.environ, ENV_BOARD: board.address(ip)}, start_new_session=True)
        except OSError as e:
            say(f"cannot run {cmd[0]!r}: {e.strerror or e}; is it on the image's PATH?")
            return 127
        run["pid"] = proc.pid
        if stopping and not board.stopped:  # a stop that came before there was a board to pass it to
            on_stop(signal.SIGTERM, None)
        code = entry.reap_until(proc, forget=run)
        board.close()
        last = board.last()
        result, why = entry.verdict(code, last, [m for m in last if m["code"] == entry.EXIT_CONFIG])
        say(f"mpirun exited {code}; {why}")
        if result == entry.EXIT_PREEMPTED and not stopping:
            if reruns >= max_reruns:
                say(f"preempted {reruns + 1} times in this pod, more than --max-reruns={max_reruns}: it exits "
                    f"{result} (the launcher Job retries it within runPolicy.backoffLimit)")
                return result
            reruns += 1
            say(f"a worker was preempted and the ranks checkpointed: mpirun runs again (rerun {reruns} of "
                f"at most {max_reruns}) once every worker's sshd answers")
            continue
        return result


def _running(marks: str) -> dict[int, int]:
    """rank -> its runner's pid, for each rank whose command is running in this pod."""
    return {m["rank"]: m["pid"] for m in entry.read_marks(marks, RUNNING) if isinstance(m.get("pid"), int)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def worker(argv: list[str]) -> int:
    opts, cmd = entry._options(argv, (), ("--marks",))
    marks = str(opts.get("--marks", entry.DEFAULT_MARKS))
    try:
        os.makedirs(marks, exist_ok=True)
        for name in os.listdir(marks):  # a restarted container's ranks are gone
            if name.startswith(RUNNING):
                os.remove(os.path.join(marks, name))
    except OSError as e:
        say(f"cannot use {marks} for the ranks' records ({e.strerror or e}): a stop ends the ranks with sshd")
    child: list[int] = []
    stopping: list[int] = []
    ranks: dict[int, int] = {}

    def on_stop(signum, _frame):
        if stopping:
            return
        stopping.append(signum)
        ranks.update(_running(marks))
        for pid in ranks.values():
            try:
                os.kill(pid, STOP_RANK)
            except ProcessLookupError:
                pass
        # the listener only (not its group: each connection's sshd, which carries a rank's orted, stays):
        # no new session from here, so after this stop whatever answers on this name is a new pod
        if child:
            try:
                os.kill(child[0], signal.SIGTERM)
            except ProcessLookupError:
                pass
        say(f"{signal.Signals(signum).name}: sshd stops listening; {len(ranks)} rank(s) told to stop, "
            f"waited for before the pod ends")

    for s in entry.STOPS:
        signal.signal(s, on_stop)
    _subreaper()
    try:
        proc = subprocess.Popen(cmd, env={**os.environ, entry.ENV_MARKS: marks}, start_new_session=True)
    except OSError as e:
        say(f"cannot run {cmd[0]!r}: {e.strerror or e}; the worker image needs openssh-server "
            f"(the rendered Dockerfile installs it)")
        return 127
    child.append(proc.pid)
    if stopping:  # a stop before sshd existed
        os.kill(proc.pid, signal.SIGTERM)
    code = entry.reap_until(proc, forget=child)  # until sshd's listener has ended
    say(f"{os.path.basename(cmd[0])} exited {code}")
    if not stopping:
        return code
    # PID 1 ending ends the container, and the ranks in it: they commit first
    while any(_alive(pid) for pid in ranks.values()):
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        time.sleep(0.1)
    # not 0: a worker's restartPolicy is OnFailure, so a pod stopped other than by its deletion restarts in
    # place (same name) for the launcher's next run
    return 128 + stopping[0]


class _Link:
    """A rank runner's connection to the board (none when the board cannot be reached: no stop is passed
    between ranks then, and a 75 is not held)."""

    def __init__(self, address: str | None, rank: int, world: int, on_stop) -> None:
        self.lock = threading.RLock()
        self.released = threading.Event()
        self.sock: socket.socket | None = None
        if not address:
            return
        host, port, self.token = address.rsplit(":", 2)
        deadline = time.monotonic() + PEER_HOLD_S
        while self.sock is None:
            try:
                self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5)
                self.sock.settimeout(None)
            except (OSError, ValueError) as e:
                if time.monotonic() >= deadline:
                    say(f"rank {rank}: cannot reach the launcher's board at {host}:{port} ({e}): a stop is not "
                        f"passed to the other ranks")
                    return
                time.sleep(0.5)
        self.send({"event": "start", "rank": rank, "world": world})
        threading.Thread(target=self._read, args=(on_stop,), daemon=True).start()

    def _read(self, on_stop) -> None:
        assert self.sock is not None
        try:
            with self.sock.makefile("r", encoding="utf-8") as lines:
                for line in lines:
                    if line.strip() == "stop":
                        on_stop("the launcher said stop")
                    elif line.strip() == "release":
                        self.released.set()
        except (OSError, ValueError):
            pass
        self.released.set()  # the board is gone: nothing to wait for

    def send(self, msg: dict) -> None:
        if self.sock is None:
            return
        with self.lock:
            try:
                self.sock.sendall((json.dumps({**msg, "token": self.token}) + "\n").encode())
            except OSError:
                pass

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


def mpi_identity(environ: dict) -> tuple[int, int, int, int]:
    """(rank, world, local rank, node rank) from what mpirun sets; ``AZULITE_*`` set from them (node rank:
    the node's index; mpirun's OMPI_COMM_WORLD_NODE_RANK is a rank's index within its node)."""
    rank, world = int(environ["OMPI_COMM_WORLD_RANK"]), int(environ["OMPI_COMM_WORLD_SIZE"])
    local = int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    per_node = max(1, int(environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1")))
    node = rank // per_node  # --map-by slot over equal slots: node k holds ranks k*per_node...
    environ.update(AZULITE_RANK=str(rank), AZULITE_LOCAL_RANK=str(local), AZULITE_NODE_RANK=str(node))
    return rank, world, local, node


def rank(argv: list[str]) -> int:
    opts, cmd = entry._options(argv, ("--python",), ())
    if opts.get("--python"):
        cmd = [sys.executable, "-u", *cmd]
    try:
        me, world, _, _ = mpi_identity(os.environ)  # type: ignore[arg-type]
    except (KeyError, ValueError):
        raise entry.UsageError("no OMPI_COMM_WORLD_RANK/_SIZE: run it under mpirun") from None
    marks = os.environ.get(entry.ENV_MARKS, entry.DEFAULT_MARKS)
    started: list[subprocess.Popen] = []
    stopped: list[str] = []  # the command was stopped (a signal that reached it, or the one sent here)
    guard = threading.RLock()
    link: list[_Link] = []

    def stop_command(why: str) -> None:
        with guard:
            if stopped:
                return
            stopped.append(why)
            proc = started[0] if started else None
        if link:
            link[0].send({"event": "stopping"})
        if proc is not None:
            proc.send_signal(signal.SIGTERM)

    def on_signal(signum, _frame):
        if signum == STOP_RANK:
            stop_command("the pod is stopped")
            return
        # orted's stop (or a group signal) reached the command itself, in this process's group: noted, not
        # passed on (a second SIGTERM could end a command already past its handler, 143 instead of 75)
        with guard:
            first = not stopped
            stopped.append(signal.Signals(signum).name)
        if first and link:
            link[0].send({"event": "stopping"})

    for s in (*entry.STOPS, STOP_RANK):
        signal.signal(s, on_signal)
    link.append(_Link(os.environ.get(ENV_BOARD), me, world, stop_command))
    with guard:
        told = bool(stopped)
    if told:  # stopped while it was connecting: the board is told now
        link[0].send({"event": "stopping"})
    running = os.path.join(marks, f"{RUNNING}{me}.json")
    try:
        proc = subprocess.Popen(cmd)
    except OSError as e:
        code = 126 if isinstance(e, PermissionError) else 127
        say(f"cannot run {cmd[0]!r}: {e.strerror or e} (exit {code}); check the job's command")
    else:
        with guard:
            started.append(proc)
            early = bool(stopped)
        if early:  # a stop that came before the command existed did not reach it: sent now
            proc.send_signal(signal.SIGTERM)
        try:
            os.makedirs(marks, exist_ok=True)
            entry._write_mark(running, {"rank": me, "pid": os.getpid()})
        except OSError as e:
            say(f"rank {me}: cannot record itself in {marks} ({e}): a stop of its pod reaches it only with sshd")
        code = entry.shell_code(proc.wait())
    try:
        os.remove(running)
    except OSError:
        pass
    link[0].send({"event": "end", "code": code})
    if code == entry.EXIT_PREEMPTED and link[0].sock is not None:
        if not link[0].released.wait(PEER_HOLD_S):
            say(f"rank {me}: not every rank ended within {PEER_HOLD_S:g}s of its exit {code}; ending anyway")
    link[0].close()
    return code


def main(argv: list[str]) -> int:
    roles = {"launcher": launcher, "worker": worker, "rank": rank}
    try:
        if not argv or argv[0] not in roles:
            raise entry.UsageError("the first word is launcher, worker or rank")
        return roles[argv[0]](argv[1:])
    except entry.UsageError as e:
        print(f"{USAGE}\nazulite pod entry: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
