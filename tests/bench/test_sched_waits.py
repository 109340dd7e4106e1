"""bench/sched_waits.py: run-queue waits by role and idle time per CPU over a window, read from the
kernel's per-task schedstat; checked with real processes made to wait for one CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.sched_waits import SchedWaits

#: after a byte on stdin, spins until the process has used this much CPU (its own CPU time), says so on
#: stdout and stays alive until stdin closes (so that its last reading is taken while it lives)
SPIN = ("import sys, time\nsys.stdin.read(1)\nwhile time.process_time() < {cpu_s}: pass\n"
        "sys.stdout.write('done'); sys.stdout.flush(); sys.stdin.read()\n")


@pytest.mark.serial  # a neighbour test busy on the "alone" CPU would make it wait as long as the crowd
@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/schedstat") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs per-task schedstat and two CPUs")
def test_processes_sharing_one_cpu_wait_for_each_other_and_one_alone_does_not() -> None:
    first, second = sorted(os.sched_getaffinity(0))[:2]
    placed = [("crowd", first)] * 3 + [("alone", second)]
    procs = [subprocess.Popen([sys.executable, "-c", SPIN.format(cpu_s=0.3)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, preexec_fn=lambda cpu=cpu: os.sched_setaffinity(0, {cpu}))
             for _, cpu in placed]
    try:
        t0 = time.monotonic()
        with SchedWaits(lambda: {p.pid: role for p, (role, _) in zip(procs, placed)}, period_s=0.02) as waits:
            for p in procs:
                p.stdin.write(b"x")
                p.stdin.flush()
            for p in procs:
                assert p.stdout.read(4) == b"done"
        wall = time.monotonic() - t0
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()
    figures = waits.figures(wall)
    waited = {role: cores * wall for role, cores in figures["runqueue_wait_cores"].items()}
    # the crowd take turns on one CPU: while one runs the other two are runnable and wait, ~0.6 s each
    # (1.8 s in all; half of it is the floor asserted, and other work on that CPU only adds to it). The one
    # alone on its CPU waits only for other work there: far less, even with that CPU more than half busy
    # (background load on it adds ~0.3 s x load / (1 - load)). Each used 0.3 s of CPU: a reading of the
    # CPU time instead of the wait would give the alone one a third of the crowd's, above the bound.
    assert waited["crowd"] > 0.9
    assert waited["alone"] < waited["crowd"] / 4
    assert set(figures["idle_cores"]) == {f"cpu{i}" for i in range(os.cpu_count())}


def test_a_role_that_never_ran_reports_no_wait_and_idle_is_per_cpu() -> None:
    with SchedWaits(lambda: {}, period_s=0.02) as waits:
        pass
    figures = waits.figures(1.0)
    assert figures["runqueue_wait_cores"] == {}
    assert all(v >= 0 for v in figures["idle_cores"].values())
