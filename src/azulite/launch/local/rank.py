"""The rank runner: ``python -m azulite.launch.local.rank --records DIR --logs DIR -- CMD...``.

Sits between the launcher (torchrun, a TF worker slot, mpirun) and the user's command for ONE rank, and
records what a launcher does not reliably report: which pid ran which rank, and that rank's exit code
(torchrun reports only the first failure, and nothing useful when it was itself signalled). It

- adds the Azure ML names torchrun lacks (NODE_RANK, node count) to the command's env,
- runs the command in its own process group-mate (same group, so torchrun's killpg reaches it),
- tees the command's stdout+stderr to ``<logs>/rank-<R>.log`` (appended across elastic restarts),
- forwards SIGTERM/SIGINT to the command and keeps waiting (so a preempted rank can commit and exit 75),
- writes ``<records>/rank-<R>.json`` when the command starts and when it ends (atomic rename), and exits
  with the command's exit code (128+N for a signal N).

Stdlib only and import-light: it starts once per rank per attempt.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from azulite.launch.env import pytorch_env_from_torchrun, rank_identity


def _write_record(path: Path, record: dict) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def shell_exit_code(returncode: int) -> int:
    """subprocess's -N for "killed by signal N" as a shell would say it (128+N)."""
    return 128 - returncode if returncode < 0 else returncode


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

    def forward(signum, _frame):  # keep waiting: the command decides how to end (e.g. exit 75)
        if proc is None:
            caught.append(signum)  # arrived before the command started: delivered once it has
            return
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
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
        for signum in caught:
            forward(signum, None)
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

    record.update(exit_code=code, ended_at=time.time())
    _write_record(record_path, record)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
