"""Ending process trees: snapshot every descendant first (psutil), SIGTERM them all, wait, SIGKILL the
survivors. Snapshotting before signalling matters: once a parent dies its children are re-parented to
init and can no longer be found from it (torchrun starts each worker in a new session, so a process
group kill of the agent alone does not reach them)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable

import psutil


def tree(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants that are alive now."""
    seen: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                seen.setdefault(p.pid, p)
        except psutil.Error:
            continue
    return list(seen.values())


def signal_all(procs: Iterable[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def signal_groups(pgids: Iterable[int], sig: int) -> list[int]:
    """``sig`` to each process group of ``pgids`` once (``killpg``: every process in it gets it once, as a
    terminal's Ctrl-C does). Returns the groups it reached; gone ones are skipped."""
    reached = []
    for pgid in dict.fromkeys(pgids):
        try:
            os.killpg(pgid, sig)
            reached.append(pgid)
        except (ProcessLookupError, PermissionError):
            continue
    return reached


#: exit statuses of this process's own children that :func:`terminate_tree` reaped: psutil's wait collects a
#: child's status, and its ``subprocess.Popen`` then reads 0 (waitpid's ECHILD), so a stopped or killed agent
#: read as one that finished. :func:`exit_status` gives them back.
_reaped: dict[int, int] = {}


def _keep_statuses(gone: Iterable[psutil.Process]) -> None:
    for p in gone:
        if getattr(p, "returncode", None) is not None:  # set only for our own children (psutil reaped them)
            _reaped[p.pid] = p.returncode


def exit_status(proc: subprocess.Popen) -> int | None:
    """``proc.poll()``, right for a child :func:`terminate_tree` reaped: its own status (-N for signal N),
    not the 0 Popen reads for a child already reaped."""
    if proc.returncode is None and proc.pid in _reaped:
        proc.returncode = _reaped.pop(proc.pid)
    return proc.poll()


def terminate_tree(pids: Iterable[int], grace_s: float, *, extra: Iterable[psutil.Process] = ()) -> list[int]:
    """SIGTERM every process in the trees of ``pids`` (and ``extra``), SIGKILL what is left after
    ``grace_s``. Returns the pids that had to be killed. The statuses of this process's own children it
    reaps are kept for :func:`exit_status`."""
    procs = {p.pid: p for p in [*tree(pids), *extra]}
    signal_all(procs.values(), signal.SIGTERM)
    gone, alive = psutil.wait_procs(list(procs.values()), timeout=grace_s)
    _keep_statuses(gone)
    # a process may have forked while we waited: take its new children too
    alive = {p.pid: p for p in [*alive, *tree(p.pid for p in alive)]}
    signal_all(alive.values(), signal.SIGKILL)
    gone, _ = psutil.wait_procs(list(alive.values()), timeout=5)
    _keep_statuses(gone)
    return sorted(alive)


def describe(procs: Iterable[psutil.Process]) -> list[str]:
    """One line per live process (pid, parent, state, threads, CPU seconds, command): a launcher's own view
    of a job it is about to kill, for the post-mortem."""
    lines = []
    for p in procs:
        try:
            with p.oneshot():
                cpu = p.cpu_times()
                lines.append(f"  pid {p.pid} ppid {p.ppid()} {p.status()} threads {p.num_threads()} "
                             f"cpu {cpu.user + cpu.system:.1f}s: {' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            continue
    return lines


def wait_any_exit(pids: Iterable[int], timeout: float) -> bool:
    """Wait until one of ``pids`` has exited (True) or ``timeout`` passed (False), woken by the exit itself
    (Linux pidfds), not at the next tick of a polling interval: a job's end is seen when it happens. Works
    for any process of this user, not only children; an exited child stays waitable (its zombie holds the
    pid until it is reaped). Where pidfds are missing (kernel < 5.3) it sleeps ``timeout``."""
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                return True  # gone already
            except (OSError, AttributeError):
                time.sleep(timeout)
                return False
        if not fds:
            time.sleep(timeout)
            return False
        return bool(select.select(fds, [], [], timeout)[0])
    finally:
        for fd in fds:
            os.close(fd)


def pid_alive(pid: int | None) -> bool:
    if not pid or pid < 0:  # negative: a claim token in the store, never a process
        return False
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now for a server that binds it a moment later (a torchrun rendezvous).

    Chosen BELOW the kernel's ephemeral range: a port from ``bind(0)`` lies inside that range, and the
    many outgoing connections of other jobs (gloo opens dozens) can take it between our check and the
    server's bind, leaving an agent connected to a stranger's store, hanging until its join timeout."""
    import random
    import socket

    lo, _ = _ephemeral_range()
    low = 20000 if lo > 21000 else 1024
    candidates = random.sample(range(low, lo), k=min(200, lo - low)) if lo - low > 0 else []
    for port in candidates:
        if not port_in_use(port, host):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free now, each from :func:`free_port` (below the kernel's ephemeral range, so no
    outgoing connection takes one before its server binds it)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if something listens on (or holds) ``host:port``: a bind attempt fails. SO_REUSEADDR as the
    rendezvous store binds, so the TIME_WAIT sockets a just-ended attempt leaves do not count as in use."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def port_owner(port: int) -> str | None:
    """``"pid 123 (python)"`` holding ``port``, when this user may see it."""
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                try:
                    return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
                except psutil.Error:
                    return f"pid {c.pid}"
    except (psutil.Error, OSError):
        return None
    return None


#: set in every process of a job: its job directory, unique across AZULITE_HOMEs (job ids are not)
ENV_JOB_DIR = "AZULITE_JOB_DIR"


def job_processes(job_dir: str | Path, *, exclude: tuple[int, ...] = ()) -> list[psutil.Process]:
    """Every live process carrying ``AZULITE_JOB_DIR=job_dir`` in its environment: catches what a job's
    script started and orphaned (re-parented to init), which no tree walk can find."""
    key = str(job_dir)
    found = []
    for p in psutil.process_iter(["pid"]):
        if p.pid in exclude:
            continue
        try:
            if p.environ().get(ENV_JOB_DIR) == key and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


__all__ = ["tree", "describe", "terminate_tree", "exit_status", "signal_all", "signal_groups", "pid_alive", "free_port",
           "free_ports", "port_in_use", "port_owner", "job_processes", "ENV_JOB_DIR"]
