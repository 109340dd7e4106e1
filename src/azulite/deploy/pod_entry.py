"""The pod's entry point around torchrun on Kubernetes: exit codes that mean what the Job's policy reads.

Under torchrun a rank's exit code is lost: torchrun restarts the group after any failed worker (its
``--max-restarts``) and, when out of restarts or stopped by SIGTERM, exits 1 whatever the ranks said. So a
rank's 78 (``EXIT_CONFIG``: an error no restart fixes) would burn every restart and the Job's retries, and
a rank's 75 (``EXIT_PREEMPTED``: checkpointed after the eviction's SIGTERM) would read as a failure. This
file runs twice in a pod, both times with the Python the image has and nothing but its standard library
(the image need not hold azulite: the file is mounted from a ConfigMap beside the manifests):

``python3 pod_entry.py agent [--exit-preempted N] -- torchrun ... pod_entry.py rank [--python] -- CMD...``

(and ``python3 pod_entry.py agent -- CMD...`` for a command run once per pod, without torchrun: PID 1's
signals and orphans are then handled for it, and its exit code is the pod's, a 75 said as
``--exit-preempted``: a TFJob's workers and parameter servers.)

- ``agent`` is the container's process (PID 1). It starts torchrun in a process group of its own and
  forwards SIGTERM/SIGINT to that group (PID 1 gets no default action for them; for a command run once per
  pod the group is the command's shell and what it runs, each stopped once), reaps what is orphaned to
  it, and exits with what the ranks said: 78 if any rank exited 78 (and at that moment it stops torchrun,
  before a restart runs the same error again); ``--exit-preempted`` (75; 143 for Kubeflow's ExitCode
  policy, which retries only signal exits) when the latest ends of its ranks include a 75 and no failure
  of a rank's own; otherwise torchrun's code.
- ``rank`` is what torchrun starts for each rank: it runs the user's command (``--python``: with torchrun's
  interpreter and ``-u``, as torchrun runs a script), outlives SIGTERM/SIGINT (torchrun's killpg reaches
  the command too, which decides how to end: a checkpoint, then 75), writes the exit code to the marks folder
  (``slot-<local rank>.json``, replaced whole: each rank process's latest end; a 78 also apart, kept) and,
  for a 78, wakes the agent with SIGUSR2.

Pod-local and stdlib only by design: it must not import azulite (``azulite.launch.local.rank`` is the
local backend's fuller runner, with logs and records). An MPIJob's pods run ``pod_mpi.py`` instead, which
imports this file (beside it in the ConfigMap) for the verdict, the option parsing and the marks. ``tests/deploy/test_pod_entry.py`` runs it around
real torchrun on loopback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

EXIT_PREEMPTED = 75  # azulite.contract.EXIT_PREEMPTED (a test keeps them equal)
EXIT_CONFIG = 78  # azulite.contract.EXIT_CONFIG
ENV_MARKS = "AZULITE_POD_MARKS"
ENV_AGENT_PID = "AZULITE_POD_AGENT_PID"
DEFAULT_MARKS = "/tmp/azulite-pod"  # the container's own disk: a restarted container starts without marks
WAKE = signal.SIGUSR2
HOLD_S = 60.0  # how long a rank that exited 78 waits for the agent's stop to reach it
STOPS = (signal.SIGTERM, signal.SIGINT)
# exit codes that are not a rank failing by itself: done, checkpointed, stopped by torchrun or the kubelet
NOT_A_CAUSE = (0, EXIT_PREEMPTED, 128 + signal.SIGINT, 128 + signal.SIGKILL, 128 + signal.SIGTERM)
USAGE = ("usage: pod_entry.py agent [--marks DIR] [--exit-preempted N] -- CMD...\n"
         "       pod_entry.py rank [--python] -- CMD...")


def say(msg: str) -> None:
    print(f"azulite pod entry: {msg}", file=sys.stderr, flush=True)


def shell_code(returncode: int) -> int:
    """A process's return code as a shell says it: 128+N for "killed by signal N" (-N)."""
    return 128 - returncode if returncode < 0 else returncode


SLOT = "slot-"  # slot-<LOCAL_RANK>.json: the latest end of each of the pod's rank processes
CONFIG = "config-error-"  # config-error-<RANK>-<round>.json: a 78, kept whatever ends after it


def read_marks(folder: str, prefix: str = SLOT) -> list[dict]:
    """The ranks' ends recorded under ``prefix`` (each written whole, by rename), in (round, rank) order."""
    marks = []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        if name.startswith(prefix) and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    marks.append(json.load(f))
            except (OSError, ValueError):  # unreadable only if removed meanwhile
                continue
    return sorted(marks, key=lambda m: (m.get("round", 0), m.get("rank", 0)))


def verdict(torchrun_code: int, last: list[dict], config: list[dict] | None = None,
            exit_preempted: int = EXIT_PREEMPTED) -> tuple[int, str]:
    """The pod's exit code, and why, from torchrun's code, each rank process's latest end (``last``: one per
    slot, so an end from before an elastic re-formation or a restart is not counted) and the 78s seen."""
    if config:
        first = min(config, key=lambda m: (m.get("ended_at", 0.0), m.get("rank", 0)))
        return EXIT_CONFIG, (f"rank {first.get('rank')} exited {EXIT_CONFIG} (an error no restart can fix): "
                             f"the pod exits {EXIT_CONFIG}, its log says what and how to fix it")
    codes = [m.get("code") for m in last]
    if not last and torchrun_code == EXIT_PREEMPTED:  # a command run once per pod (a TFJob's task) said it
        return exit_preempted, (f"the command exited {EXIT_PREEMPTED} (checkpointed, preempted): the pod exits "
                                f"{exit_preempted}")
    if torchrun_code != 0 and EXIT_PREEMPTED in codes and all(c in NOT_A_CAUSE for c in codes):
        who = sorted(m.get("rank") for m in last if m.get("code") == EXIT_PREEMPTED)
        return exit_preempted, (f"rank(s) {', '.join(map(str, who))} exited {EXIT_PREEMPTED} (checkpointed, "
                                f"preempted), no rank failed: the pod exits {exit_preempted}")
    return torchrun_code, f"it exits {torchrun_code}"


def reap_until(proc: subprocess.Popen, forget: list | dict | None = None) -> int:
    """Reap every child (as PID 1, orphans are ours too) until ``proc`` ends; its code as a shell says it.
    ``forget`` is cleared at that moment: nothing is sent to a pid that may be reused."""
    while True:
        try:
            ended, status = os.waitpid(-1, 0)
        except ChildProcessError:  # not ours to reap after all (cannot happen: proc is our child)
            return 1
        if ended == proc.pid:
            if forget is not None:
                forget.clear()
            proc.returncode = shell_code(os.waitstatus_to_exitcode(status))
            return proc.returncode


class UsageError(Exception):
    """A mistake in the pod's command line (a hand-edited manifest): said in one line, exit 2."""


def _options(argv: list[str], flags: tuple[str, ...], valued: tuple[str, ...]) -> tuple[dict, list[str]]:
    if "--" not in argv:
        raise UsageError("no '--' before the command")
    split = argv.index("--")
    opts: dict[str, str | bool] = {}
    it = iter(argv[:split])
    for a in it:
        name, eq, value = a.partition("=")
        if a in flags:
            opts[a] = True
        elif name in valued:
            value = value if eq else next(it, None)
            if value is None:
                raise UsageError(f"{name} needs a value")
            opts[name] = value
        else:
            raise UsageError(f"unknown option {a!r}")
    cmd = argv[split + 1:]
    if not cmd:
        raise UsageError("no command after '--'")
    return opts, cmd


def agent(argv: list[str]) -> int:
    opts, cmd = _options(argv, (), ("--marks", "--exit-preempted"))
    marks = str(opts.get("--marks", DEFAULT_MARKS))
    raw = str(opts.get("--exit-preempted", EXIT_PREEMPTED))
    if not raw.isdigit() or not 0 < int(raw) < 256:
        raise UsageError(f"--exit-preempted takes an exit code from 1 to 255, not {raw!r}")
    exit_preempted = int(raw)
    env = {**os.environ, ENV_MARKS: marks, ENV_AGENT_PID: str(os.getpid())}
    try:
        os.makedirs(marks, exist_ok=True)
        for name in os.listdir(marks):  # another container's ends are not this one's
            if name.startswith((SLOT, CONFIG)):
                os.remove(os.path.join(marks, name))
    except OSError as e:
        say(f"cannot use {marks} for the ranks' exit codes ({e.strerror or e}): the pod exits as torchrun does")
        del env[ENV_MARKS]
    child: list[int] = []  # torchrun's pid (and group) while it runs (os.killpg, not Popen.send_signal: its
    stopping: list[str] = []  # poll() could reap torchrun inside a handler, under the wait below)
    early: list[int] = []  # stop signals that came before torchrun did: sent once it exists

    def send(signum: int) -> None:
        if not child:
            early.append(signum)
            return
        try:
            os.killpg(child[0], signum)
        except ProcessLookupError:
            pass

    def stop(why: str) -> None:
        if not stopping:
            stopping.append(why)
            say(f"{why}: stopping torchrun (SIGTERM to it, which passes it to every rank)")
            send(signal.SIGTERM)

    def on_stop(signum, _frame):
        send(signum)  # torchrun stops its ranks with it; they checkpoint and exit 75

    def on_wake(_signum, _frame):
        bad = read_marks(marks, CONFIG)
        if bad:
            stop(f"rank {bad[0].get('rank')} exited {EXIT_CONFIG}, an error no restart can fix")

    for s in STOPS:
        signal.signal(s, on_stop)
    signal.signal(WAKE, on_wake)
    try:
        # held: a dropped Popen may be polled (reaped) by the next one
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    except OSError as e:
        say(f"cannot run {cmd[0]!r}: {e.strerror or e}; is it on the image's PATH?")
        return 127
    pid = proc.pid
    child.append(pid)
    for signum in list(early):
        send(signum)
    on_wake(WAKE, None)  # a rank may have ended before the handler could find torchrun
    code = reap_until(proc, forget=child)
    result, why = verdict(code, read_marks(marks), read_marks(marks, CONFIG), exit_preempted)
    say(f"{os.path.basename(cmd[0])} exited {code}; {why}")
    return result


def _write_mark(path: str, mark: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(mark, f)
    os.replace(tmp, path)


def rank(argv: list[str]) -> int:
    opts, cmd = _options(argv, ("--python",), ())
    if opts.get("--python"):
        cmd = [sys.executable, "-u", *cmd]
    started: list[subprocess.Popen] = []
    caught: list[int] = []

    def note(signum, _frame):
        # keep waiting: the command decides how to end (a checkpoint, then 75). Not passed on: torchrun
        # stops a rank with killpg, which reaches the command (in this process's group) directly, and a
        # second SIGTERM could end a command already past its handler, exiting 143 instead of 75
        caught.append(signum)

    for s in STOPS:
        signal.signal(s, note)
    try:
        started.append(subprocess.Popen(cmd))
    except OSError as e:
        code = 126 if isinstance(e, PermissionError) else 127
        say(f"cannot run {cmd[0]!r}: {e.strerror or e} (exit {code}); check the job's command")
    else:
        for s in caught:  # came before the command existed, so did not reach it: passed on now
            started[0].send_signal(s)
        code = shell_code(started[0].wait())
    folder = os.environ.get(ENV_MARKS)
    if folder:
        env = os.environ
        mark = {"rank": int(env.get("RANK", "0")), "local_rank": int(env.get("LOCAL_RANK", "0")),
                "round": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), "code": code, "pid": os.getpid(),
                "ended_at": time.time()}
        try:
            if code == EXIT_CONFIG:  # first: the slot's file is overwritten by whatever ends there next
                _write_mark(os.path.join(folder, f"{CONFIG}{mark['rank']}-{mark['round']}.json"), mark)
            _write_mark(os.path.join(folder, f"{SLOT}{mark['local_rank']}.json"), mark)
        except OSError as e:  # the agent then goes by torchrun's code alone
            say(f"cannot record rank {mark['rank']}'s exit in {folder}: {e}")
        if code == EXIT_CONFIG and os.environ.get(ENV_AGENT_PID, "").isdigit():
            _hold_until_stopped(int(os.environ[ENV_AGENT_PID]), caught)
    return code


def _hold_until_stopped(agent_pid: int, caught: list[int]) -> None:
    """Wake the agent and stay until its stop reaches this rank (torchrun's SIGTERM to every rank): torchrun
    sees the rank fail only when this process ends, so it is stopped before it could restart the group."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # from here a stop waits for sigtimedwait below
    if caught:
        return  # stopped already (the agent, by another rank's 78, or the kubelet)
    try:
        os.kill(agent_pid, WAKE)
    except OSError:  # no agent to stop torchrun: end now, torchrun goes by its own rules
        return
    if signal.sigtimedwait(STOPS, HOLD_S) is None:
        say(f"no stop reached this rank {HOLD_S:g}s after its exit {EXIT_CONFIG}; ending it anyway")


def main(argv: list[str]) -> int:
    try:
        if argv and argv[0] == "agent":
            return agent(argv[1:])
        if argv and argv[0] == "rank":
            return rank(argv[1:])
        raise UsageError("the first word is agent or rank")
    except UsageError as e:
        print(f"{USAGE}\nazulite pod entry: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
