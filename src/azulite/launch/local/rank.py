"""The rank runner: ``python -m azulite.launch.local.rank --records DIR --logs DIR -- CMD...``.

Sits between the launcher (torchrun, a TF worker slot, mpirun) and the user's command for ONE rank, and
records what a launcher does not reliably report: which pid ran which rank, and that rank's exit code
(torchrun reports only the first failure, and nothing useful when it was itself signalled). It

- adds the Azure ML names torchrun lacks (NODE_RANK, node count) to the command's env,
- runs the command in its own process group-mate (same group, so torchrun's killpg reaches it),
- tees the command's stdout+stderr to ``<logs>/rank-<R>.log`` (appended across elastic restarts),
- on SIGTERM/SIGINT keeps waiting for the command (so a preempted rank can commit and exit 75) and does
  NOT pass the signal on: whoever stops a rank signals its process group (torchrun's killpg, Open MPI's,
  the supervisor's), which the command shares, and a second SIGTERM landing after a script's handler
  returned would turn its 75 into 143; only a signal that came before the command started is passed on
  once it has,
- writes ``<records>/rank-<R>.json`` when the command starts and when it ends (atomic rename), and exits
  with the command's exit code (128+N for a signal N); a command that exited ``EXIT_CONFIG`` (78: an error
  no restart can fix) is also written to ``config-error-rank-<R>.json``, which the supervisor acts on,
- makes a hang readable: SIGUSR1 prints its own stacks into the rank's log (faulthandler), and a rank still
  running ``AZULITE_STOP_DUMP_S`` (20) seconds after a stop signal gets SIGUSR1 too (``azulite.train``
  prints every thread's stack) along with the runner's own stacks: before torchrun's SIGKILL at 30 s.

Stdlib only and import-light: it starts once per rank per attempt.
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from azulite.contract import ENV_STOP_DUMP_S, EXIT_CONFIG, STACK_DUMP_SIGNAL, STOP_DUMP_S_DEFAULT
from azulite.launch.env import pytorch_env_from_torchrun, rank_identity
from azulite.launch.local.stacks import descendants, request_dumps


def _write_record(path: Path, record: dict) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def config_error_path(records: Path, rank: int) -> Path:
    """Where a rank whose command exited ``EXIT_CONFIG`` says so: apart from ``rank-R.json``, which the
    launcher's restart of the rank (torchrun's max_restarts) rewrites before the supervisor may have read it."""
    return records / f"config-error-rank-{rank}.json"


def config_errors(records: Path) -> list[dict]:
    """The records of this attempt's ranks that exited ``EXIT_CONFIG``, the first to end first."""
    found = []
    for p in records.glob("config-error-rank-*.json"):
        try:
            found.append(json.loads(p.read_text()))
        except (OSError, ValueError):  # renamed into place whole: unreadable only if gone meanwhile
            continue
    return sorted(found, key=lambda r: (r.get("ended_at") or 0.0, r.get("rank", 0)))


def shell_exit_code(returncode: int) -> int:
    """subprocess's -N for "killed by signal N" as a shell would say it (128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def stop_dump_after(env: dict[str, str]) -> float:
    raw = env.get(ENV_STOP_DUMP_S, "")
    try:
        return float(raw) if raw.strip() else STOP_DUMP_S_DEFAULT
    except ValueError:
        return STOP_DUMP_S_DEFAULT  # a diagnostic is not worth failing a rank over


def _stop_watchdog(proc: subprocess.Popen, wake_fd: int, after_s: float, log: BinaryIO, rank: int) -> None:
    """Once woken by a stop signal: if the command has not exited ``after_s`` later, write why into the log,
    then the runner's own stacks, then ask the command (and what it started) for theirs."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (OSError, AttributeError):  # kernel < 5.3: no way to wait for the exit here without polling
        return
    try:
        if pidfd in select.select([wake_fd, pidfd], [], [])[0]:
            return  # ended before any stop signal
        if select.select([pidfd], [], [], after_s)[0]:
            return  # stopped in time
        log.write(f"azulite: rank {rank} (pid {proc.pid}) still running {after_s:g}s after a stop signal; "
                  f"stacks of the rank runner, then of the rank, follow (a diagnostic: the rank goes on)\n".encode())
        faulthandler.dump_traceback(file=log, all_threads=True)
        sent = request_dumps([proc.pid, *descendants(proc.pid)], STACK_DUMP_SIGNAL)
        if not sent:
            log.write(f"azulite: rank {rank}'s command does not print stacks on signal {STACK_DUMP_SIGNAL} "
                      f"(it does when it calls azulite.train.init)\n".encode())
    except (OSError, ValueError):  # the log closed under us: the rank ended meanwhile
        pass
    finally:
        os.close(pidfd)


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: python -m azulite.launch.local.rank --records DIR --logs DIR -- CMD...", file=sys.stderr)
        return 2
    split = argv.index("--")
    opts, cmd = argv[:split], argv[split + 1 :]
    args = dict(zip(opts[0::2], opts[1::2]))
    records, logs = Path(args["--records"]), Path(args["--logs"])
    records.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)

    env = dict(os.environ)
    env.update(pytorch_env_from_torchrun(env))
    ident = rank_identity(env) or (0, 0, 0)
    rank, local_rank, node_rank = ident
    log_path = logs / f"rank-{rank}.log"
    record_path = records / f"rank-{rank}.json"
    record = {
        "rank": rank,
        "local_rank": local_rank,
        "node_rank": node_rank,
        "pid": os.getpid(),
        "agent_pid": os.getppid(),  # the launcher that started this rank (which node agent, across rejoins)
        "child_pid": None,
        "restart": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "log": str(log_path),
        "started_at": time.time(),
        "ended_at": None,
        "exit_code": None,
    }

    proc: subprocess.Popen | None = None
    caught: list[int] = []
    # the handler only writes a byte here (no locks: it may run inside itself when signals come in bursts)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def on_stop(signum, _frame):  # keep waiting: the command decides how to end (e.g. exit 75)
        try:
            os.write(wake_w, b"s")
        except OSError:  # full: the watchdog is awake already
            pass
        if proc is None:  # came before the command started, so its group signal missed it: passed on below
            caught.append(signum)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    with open(log_path, "ab", buffering=0) as log:
        try:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        except OSError as e:  # a typo in the job's command: say so in the rank's log, exit as a shell would
            code = 126 if isinstance(e, PermissionError) else 127
            log.write(f"azulite: cannot run {cmd[0]!r}: {e.strerror or e} (exit {code}); check the job's "
                      f"command and that the program is on PATH or in the code folder\n".encode())
            record.update(exit_code=code, ended_at=time.time())
            _write_record(record_path, record)
            return code
        record["child_pid"] = proc.pid
        _write_record(record_path, record)
        faulthandler.register(STACK_DUMP_SIGNAL, file=log, all_threads=True)
        after_s = stop_dump_after(env)
        watchdog = None
        if after_s > 0:
            watchdog = threading.Thread(target=_stop_watchdog, args=(proc, wake_r, after_s, log, rank),
                                        name="azulite-stop-watchdog", daemon=True)
            watchdog.start()
        for signum in caught:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass
        out = sys.stdout.buffer
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            log.write(line)
            try:
                out.write(line)
                out.flush()
            except (BrokenPipeError, ValueError):
                pass
        code = shell_exit_code(proc.wait())
        faulthandler.unregister(STACK_DUMP_SIGNAL)
        if watchdog is not None:  # it returns at once now (the exit made its pidfd readable); never let it
            watchdog.join()       # write through a closed log's fd, which the record file may reuse

    record.update(exit_code=code, ended_at=time.time())
    _write_record(record_path, record)
    if code == EXIT_CONFIG:
        _write_record(config_error_path(records, rank), record)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
