"""``azulite agent``: keep looking after this machine's local jobs, so a job whose supervisor died (or a
machine restart) is requeued from its last committed checkpoint without anyone running a command.

Start it once per machine (a systemd unit, a tmux pane, a container's command); it stops on SIGTERM or
Ctrl-C. Its first look is at once, so started at boot it requeues what the machine's restart stopped.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict

import typer

from azulite.errors import AzuliteError
from azulite.launch.backend import get_backend
from azulite.launch.settings import Settings


#: the longest wait between looks: a day (a job whose supervisor died waits that long to be requeued)
MAX_INTERVAL_S = 86400


def agent(
    interval: float = typer.Option(10.0, "--interval", help="Seconds between looks."),
    json_: bool = typer.Option(False, "--json", help="One JSON object per change."),
) -> None:
    """Requeue local jobs whose supervisor died, on a clock.  Example: azulite agent --interval 5"""
    if not 0 < interval <= MAX_INTERVAL_S:  # nan and inf too: a wait that long overflows the clock's timeout
        raise AzuliteError(f"--interval {interval:g} must be above 0 and at most {MAX_INTERVAL_S} seconds (a day)",
                           where="--interval", fix="e.g. --interval 10")
    settings = Settings.from_environ()
    if settings.backend != "local":
        raise AzuliteError(f"azulite agent looks after local jobs; AZULITE_BACKEND is {settings.backend!r}",
                           where="AZULITE_BACKEND", fix="unset AZULITE_BACKEND (or set it to local)")
    from azulite.launch.local.watch import watch  # the local backend only when asked for

    backend = get_backend("local", settings)
    stop = threading.Event()

    def report(change) -> None:  # noqa: ANN001 - watch.Change
        line = json.dumps({"ts": time.time(), **asdict(change)}) if json_ else f"{time.strftime('%H:%M:%S')} {change}"
        print(line, flush=True)

    # The handler only writes a byte; a thread sets the event. Event.set takes a lock the main thread may
    # hold at that moment (inside stop.wait), or a first handler may (a second signal landing inside it):
    # the agent would then deadlock on itself, as preempted ranks did (issue 9).
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def on_signal(*_: object) -> None:
        try:
            os.write(wake_w, b"x")
        except BlockingIOError:  # a byte already waits: the event will be set
            pass

    threading.Thread(target=lambda: (os.read(wake_r, 1), stop.set()), name="azulite-agent-signals",
                     daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    print(f"azulite agent: looking after the jobs in {settings.home} every {interval:g}s (pid "
          f"{os.getpid()})", file=sys.stderr, flush=True)
    looks = watch(backend, interval=interval, stop=stop, report=report)
    print(f"azulite agent: stopped after {looks} look(s)", file=sys.stderr, flush=True)


def register(app: typer.Typer) -> None:
    app.command("agent")(agent)
