"""Stack dumps of a job's processes without a debugger: ask the ones that registered
``faulthandler`` on :data:`azulite.contract.STACK_DUMP_SIGNAL` (training processes, rank runners) to print
every thread's Python stack into their logs, where a hang is read afterwards.

Stdlib only (the rank runner imports it). A process that did not register the signal is never sent it:
its default action would end the process. Whether a process catches a signal is read from the kernel
(``SigCgt`` in ``/proc/PID/status``), not guessed from its command line.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (False when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def descendants(pid: int) -> list[int]:
    """The live descendants of ``pid`` (children first), from /proc's per-thread child lists."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop(0)
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except (OSError, ValueError):
                continue
            for k in kids:
                if k not in out:
                    out.append(k)
                    todo.append(k)
    return out


def request_dumps(pids: Iterable[int], sig: int) -> list[int]:
    """Send ``sig`` to each of ``pids`` that catches it; the pids it was sent to."""
    sent = []
    for pid in dict.fromkeys(pids):
        if pid and pid > 0 and catches(pid, sig):
            try:
                os.kill(pid, sig)
                sent.append(pid)
            except OSError:
                continue
    return sent


def live_rank_pids(records: dict[int, dict]) -> list[int]:
    """From the rank runners' records: each unfinished rank's runner, its command and what that started."""
    pids: list[int] = []
    for rec in records.values():
        if rec.get("exit_code") is None and rec.get("child_pid"):
            child = int(rec["child_pid"])
            pids += [int(rec["pid"]), child, *descendants(child)]
    return pids
