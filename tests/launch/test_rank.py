"""The rank runner's hang diagnostics, on real processes: a rank that ignores the stop signal gets its
every thread's stack printed into its log (azulite.train registered faulthandler), beside the runner's own;
a command that never registered the dump signal is told so and left running (SIGUSR1 would end it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from azulite.contract import STACK_DUMP_SIGNAL
from azulite.launch.local.stacks import catches, descendants, request_dumps
from tests.launch.jobkit import wait_for


def start_runner(tmp_path: Path, script: str, *, dump_after: str) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "rank.py").write_text(textwrap.dedent(script))
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "AZULITE_STOP_DUMP_S": dump_after}
    proc = subprocess.Popen(
        [sys.executable, "-m", "azulite.launch.local.rank", "--records", str(tmp_path / "records"),
         "--logs", str(tmp_path / "logs"), "--", sys.executable, str(tmp_path / "rank.py")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
    )
    return proc, tmp_path / "logs" / "rank-0.log"


def stop(proc: subprocess.Popen) -> None:
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def text(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


IGNORES_THE_STOP = """
    import signal, threading
    from azulite import train

    train.init({})  # registers the stack dump signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank that never acts on the stop

    def stuck_in_a_step():
        print("ready", flush=True)
        threading.Event().wait()

    threading.Thread(target=threading.Event().wait, name="a-reader-thread", daemon=True).start()
    stuck_in_a_step()
"""


def test_a_rank_that_ignores_the_stop_has_its_stacks_and_the_runners_in_its_log(tmp_path):
    proc, log = start_runner(tmp_path, IGNORES_THE_STOP, dump_after="0.5")
    try:
        wait_for(lambda: "ready" in text(log), 120, "the rank to start")
        os.kill(proc.pid, signal.SIGTERM)  # a stop reaches the runner (its group's), and the rank ignores it
        # every thread of both: the runner's main and watchdog threads, the rank's main and reader threads
        out = wait_for(lambda: (t := text(log)) and "in stuck_in_a_step" in t and t.lower().count("thread 0x") >= 4
                       and t, 60, "the rank's stacks in its log")
        assert "still running 0.5s after a stop signal" in out
        assert "in _stop_watchdog" in out and "launch/local/rank.py\", line" in out  # the runner's own threads
        assert out.index("in _stop_watchdog") < out.index("in stuck_in_a_step")
        assert proc.poll() is None  # a diagnostic, not a kill: the rank and its runner go on
    finally:
        stop(proc)


def test_a_command_without_the_dump_handler_is_told_so_and_left_running(tmp_path):
    proc, log = start_runner(tmp_path, """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(3600)
    """, dump_after="0.5")
    try:
        wait_for(lambda: "ready" in text(log), 60, "the rank to start")
        child = descendants(proc.pid)
        assert len(child) == 1 and not catches(child[0], STACK_DUMP_SIGNAL)
        os.kill(proc.pid, signal.SIGTERM)
        wait_for(lambda: "does not print stacks" in text(log), 60, "the runner's note")
        os.kill(child[0], 0)  # still alive: SIGUSR1's default action would have ended it
        assert proc.poll() is None
    finally:
        stop(proc)


def test_the_runner_passes_no_stop_signal_on(tmp_path):
    """Whoever stops a rank signals its process group, which the command shares: a SIGTERM the runner passed
    on would be a second one (a script past its handler then exits 143, not 75). The command counts the
    SIGTERMs delivered to it until the runner's stop watchdog, woken by the runner's own handler, sends it
    SIGUSR1 (the forward, if any, went from that same handler half a second before)."""
    proc, log = start_runner(tmp_path, """
        import os, signal, sys
        r, w = os.pipe()
        os.set_blocking(w, False)
        os.set_blocking(r, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)  # a byte per delivery, however close together
        signal.signal(signal.SIGTERM, lambda *_: None)
        def report(*_):
            try:
                got = os.read(r, 64)
            except BlockingIOError:
                got = b""
            print(f"sigterms={got.count(signal.SIGTERM)}", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGUSR1, report)
        print("ready", flush=True)
        while True:
            signal.pause()
    """, dump_after="0.5")
    try:
        wait_for(lambda: "ready" in text(log), 60, "the rank to start")
        os.kill(proc.pid, signal.SIGTERM)  # the runner alone
        assert proc.wait(timeout=60) == 0
        assert "sigterms=0" in text(log), text(log)
    finally:
        stop(proc)


def test_no_stop_signal_no_dump(tmp_path):
    proc, log = start_runner(tmp_path, """
        print("done", flush=True)
    """, dump_after="0.01")
    assert proc.wait(timeout=60) == 0
    assert "done" in text(log) and "still running" not in text(log)


def test_catches_reads_the_kernels_view_and_request_dumps_skips_the_others():
    old = signal.signal(signal.SIGUSR2, lambda *_: None)
    try:
        assert catches(os.getpid(), signal.SIGUSR2)
    finally:
        signal.signal(signal.SIGUSR2, old)
    assert not catches(os.getpid(), signal.SIGUSR2)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        assert request_dumps([sleeper.pid], STACK_DUMP_SIGNAL) == []
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not catches(sleeper.pid, signal.SIGUSR2)  # gone: False, not an error


@pytest.mark.parametrize("raw,expected", [("", 20.0), ("0", 0.0), ("2.5", 2.5), ("soon", 20.0)])
def test_stop_dump_after(raw, expected):
    from azulite.launch.local.rank import stop_dump_after

    assert stop_dump_after({"AZULITE_STOP_DUMP_S": raw}) == expected
