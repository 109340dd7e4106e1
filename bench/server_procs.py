"""The servers' process trees as bench/serving_workers.py reads them from /proc: which part of a server
a process is (its role), the CPU each part used, the descendants of a server, the processes a run left
behind, and who counts as which role for bench/sched_waits.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_ns(pid: int) -> float:
    """CPU time of every thread of ``pid`` so far, in ns (schedstat; /proc/PID/stat counts 10 ms ticks)."""
    total = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            total += float(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total


def _role(pid: int) -> str:
    """Which part of a server a process is: its model instances (azulite's instance processes, Triton's
    Python stubs), the model host or a front-end of ``--workers N``, else "main" (a single-process
    server, the supervisor of ``--workers N``, tritonserver itself)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "main"
    if b"azulite.serve.instances" in cmd or b"triton_python_backend_stub" in cmd:
        return "instances"
    if b"azulite.serve.workers\0host" in cmd:
        return "host"
    if b"azulite.serve.workers\0frontend" in cmd:
        return "frontends"
    return "main"


def tree_cpu(pid: int) -> dict[str, float]:
    """User + system seconds of pid and every live descendant, plus what they reaped, by role
    (:func:`_role`). Parents come from each process's stat (a process's task/*/children lists only the
    children of that one thread, and Triton starts its Python stubs from other threads)."""
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stats[int(entry)] = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
    kids: dict[int, list[int]] = {}
    for p, fields in stats.items():
        kids.setdefault(int(fields[1]), []).append(p)
    by_role: dict[str, float] = {}
    stack = [pid]
    while stack:
        p = stack.pop()
        if p in stats:
            role = _role(p)
            by_role[role] = by_role.get(role, 0.0) + sum(int(stats[p][i]) for i in (11, 12, 13, 14)) / TICK
        stack += kids.get(p, [])
    return by_role


def kill_strays(work: Path, grace_s: float = 5.0, *, orphans_only: bool = False) -> list[int]:
    """End every process still naming this run's folder in its command line (``orphans_only``: only those
    whose parent is gone, while other servers of the run still serve), and unlink the /dev/shm regions
    such a process names: a tritonserver that aborts while starting leaves its Python stubs running,
    orphaned (seen here: SIGABRT at start-up, two stubs still up 12 minutes later; they ignore SIGTERM,
    hence the SIGKILL after ``grace_s``)."""
    mark = str(work).encode()

    def naming() -> dict[int, bytes]:
        out = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                except OSError:
                    continue
                if mark in cmd and (not orphans_only or _parent(int(entry)) == 1):
                    out[int(entry)] = cmd
        return out

    found = naming()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in naming() if sig == signal.SIGKILL else found:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while sig == signal.SIGTERM and time.monotonic() < deadline and naming():
            time.sleep(0.1)
    for cmd in found.values():
        for arg in cmd.split(b"\0"):
            if arg.startswith(b"triton_python_backend_shm_region_") and b"/" not in arg:
                Path("/dev/shm", arg.decode()).unlink(missing_ok=True)
    return sorted(found)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def tree_pids(pid: int) -> list[int]:
    """pid and every live descendant."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parents[int(entry)] = _parent(int(entry))
    found, stack = [], [pid]
    while stack:
        p = stack.pop()
        found.append(p)
        stack += [c for c, parent in parents.items() if parent == p]
    return found


def instance_pids(pid: int) -> list[int]:
    """The model-instance processes (:func:`_role`) under pid."""
    return [p for p in tree_pids(pid) if p != pid and _role(p) == "instances"]


def point_roles(server_pid: int):
    """For :class:`SchedWaits`: the server's processes by role (its tree, read once: it does not change
    within a point) and this bench's perf_analyzer or h2load (a child; the other servers, also children,
    are not this point's) as the load generator."""
    tree = {p: _role(p) for p in tree_pids(server_pid)}

    def roles() -> dict[int, str]:
        out = dict(tree)
        for tid in os.listdir("/proc/self/task"):
            for child in Path(f"/proc/self/task/{tid}/children").read_text().split():
                try:
                    if Path(f"/proc/{child}/comm").read_text().strip() in ("perf_analyzer", "h2load"):
                        out[int(child)] = "load_generator"
                except OSError:
                    continue
        return out
    return roles


def tree_cpu_s(pid: int) -> float:
    return sum(tree_cpu(pid).values())
