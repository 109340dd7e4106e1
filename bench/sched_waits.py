"""Who waits for a CPU while a core sits idle, over one benchmark point (bench/serving_workers.py).

Per role (a server's parts as the bench names them, and the load generator), the time its threads spent
runnable but not running (the kernel's per-task ``/proc/PID/task/TID/schedstat``, second field: run-queue
wait in ns; this kernel has no system-wide /proc/schedstat), and per CPU the time it sat idle
(``/proc/stat``). Both as cores: seconds over the window's wall seconds. A core idle while some role
waits is time the scheduler's placement left unused (e.g. a load generator pinned to a core where a
model instance spins while the other core idles); waits with no idle core are the cores being short.

Threads come and go within a point (perf_analyzer's workers, the server's executors), so a sampler
thread reads every matching task every ``period_s`` and keeps each one's first and last reading; a task's
wait before its first reading or after its last is not counted (at most ``period_s`` each).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable


def _idle_ticks() -> dict[str, int]:
    """Per CPU, idle + iowait ticks so far (/proc/stat)."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and not line.startswith("cpu "):
            f = line.split()
            out[f[0]] = int(f[4]) + int(f[5])
    return out


class SchedWaits:
    """Run-queue waits by role and idle time per CPU over ``with SchedWaits(roles) as w: ...``, then
    :meth:`figures` (wall seconds given by the caller, the same as the point's). ``roles()`` returns the
    pids to watch, each with its role, at the moment it is called (read at every sample)."""

    def __init__(self, roles: Callable[[], dict[int, str]], period_s: float = 0.1) -> None:
        self._roles, self._period = roles, period_s
        self._first: dict[tuple[int, int], int] = {}
        self._last: dict[tuple[int, int], tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sched-waits", daemon=True)

    def __enter__(self) -> "SchedWaits":
        self._idle0 = _idle_ticks()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self._idle1 = _idle_ticks()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self._sample()

    def _sample(self) -> None:
        try:
            roles = self._roles()
        except OSError:
            return
        for pid, role in roles.items():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    wait = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                key = (pid, int(tid))
                self._first.setdefault(key, wait)
                self._last[key] = (role, wait)

    def figures(self, wall_s: float) -> dict:
        """``runqueue_wait_cores`` by role and ``idle_cores`` per CPU, each seconds / wall_s."""
        waits: dict[str, float] = {}
        for key, (role, wait) in self._last.items():
            waits[role] = waits.get(role, 0.0) + (wait - self._first[key]) / 1e9
        tick = os.sysconf("SC_CLK_TCK")
        idle = {cpu: (self._idle1[cpu] - self._idle0.get(cpu, self._idle1[cpu])) / tick for cpu in self._idle1}
        return {"runqueue_wait_cores": {k: round(v / wall_s, 3) for k, v in sorted(waits.items())},
                "idle_cores": {k: round(v / wall_s, 3) for k, v in sorted(idle.items())}}
