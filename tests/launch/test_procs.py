"""Ending a child's tree keeps the child's own exit status (``procs.terminate_tree``, ``procs.exit_status``).
Waiting for a process's end (``procs.wait_any_exit``): woken by the exit itself, for a child and for a
process of another parent (a sweep's driver waits on its trials' detached supervisors). Free ports for
servers started a moment later (``procs.free_ports``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import signal

import pytest

from azulite.launch.local.procs import _ephemeral_range, exit_status, free_ports, terminate_tree, wait_any_exit

# reads a FIFO to its end: it exits when the test closes the writing side, at a moment the test picks
READER = "import sys; open(sys.argv[1]).read()"


def _waits_until_exit(pid: int, release) -> None:
    """A wait far longer than any test runs returns once ``release()`` ends the process: only the exit can
    have woken it."""
    assert wait_any_exit([pid], 0) is False  # alive: a zero wait says so
    result: list[bool] = []
    done = threading.Event()
    threading.Thread(target=lambda: (result.append(wait_any_exit([os.getpid(), pid], 3600)), done.set()),
                     daemon=True).start()
    release()
    assert done.wait(120), "the wait was not woken by the process's exit"
    assert result == [True]


def test_a_childs_exit_wakes_the_wait(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    child = subprocess.Popen([sys.executable, "-c", READER, str(fifo)])
    writer = open(fifo, "w")  # blocks until the child has opened its end
    try:
        _waits_until_exit(child.pid, writer.close)
    finally:
        writer.close()
        assert child.wait(120) == 0


def test_the_exit_of_a_process_of_another_parent_wakes_the_wait(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # a double fork, as a detached supervisor is started: the reader is re-parented, not our child
    spawn = ("import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], "
             "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
    out = subprocess.run([sys.executable, "-c", spawn, READER, str(fifo)], capture_output=True, text=True, timeout=120)
    pid = int(out.stdout)
    writer = open(fifo, "w")
    try:
        _waits_until_exit(pid, writer.close)
    finally:
        writer.close()
    assert wait_any_exit([pid], 0) is True  # gone (reaped by init): at once


def test_no_pids_waits_the_timeout_and_says_no_exit():
    assert wait_any_exit([], 0) is False


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    """Below the range the kernel gives outgoing connections, so a neighbour's connection cannot take one
    between the pick and the server's bind (a port from bind(0) lies inside it). Bindable as the servers
    they are for bind them (the rendezvous store, uvicorn, Azurite): with SO_REUSEADDR, so that a port whose
    last server's connections are still in TIME_WAIT counts as free (a plain bind is refused there: a test
    beside others once failed so)."""
    lo, _ = _ephemeral_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < lo for p in ports), (ports, lo)
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()


# prints once its SIGTERM disposition is set, then waits for its stdin to close (never, here)
STOPPABLE = "import signal, sys; signal.signal(signal.SIGTERM, {}); print('ready', flush=True); sys.stdin.read()"


@pytest.mark.parametrize("on_term, status", [("signal.SIG_DFL", -signal.SIGTERM), ("signal.SIG_IGN", -signal.SIGKILL)])
def test_a_child_ended_by_terminate_tree_keeps_its_own_status(on_term, status):
    """psutil's wait reaps the child, after which Popen.poll() reads 0: a stopped or killed agent read as
    one that finished (a canceled TF job listed its workers as exit 0)."""
    child = subprocess.Popen([sys.executable, "-c", STOPPABLE.format(on_term)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    terminate_tree([child.pid], 0.5 if on_term == "signal.SIG_IGN" else 60)
    assert exit_status(child) == status
    assert exit_status(child) == status  # read twice, the same
    child.stdin.close()
    child.stdout.close()
