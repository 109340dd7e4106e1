"""How the local backend starts one attempt of a job: a *launch strategy* per distribution type.

The supervisor (``supervisor.py``) knows nothing about torchrun, TF_CONFIG or mpirun. For each attempt it
builds a :class:`LaunchContext`, asks the strategy registered for ``spec.distribution.type`` for

1. :meth:`LaunchStrategy.preflight` — raise :class:`~azulite.errors.LaunchError` for anything that would
   stop the job from starting (a port in use, ``mpirun`` not installed). Called at submit time (in the
   submitting shell, so the user sees the error and nothing starts) and again before each attempt.
2. :meth:`LaunchStrategy.processes` — the list of :class:`ProcessSpec` to start: one per simulated node
   for pytorch (a torchrun agent) and mpi (one ``mpirun``), one per worker for tensorflow. The supervisor
   starts each in its own session (``start_new_session=True``) with ``argv``/``env``/``cwd``, sends its
   stdout+stderr to ``log``, records its pid, and on cancel/preempt signals the whole process tree.
3. :meth:`LaunchStrategy.collect` — after every process ended, the per-rank results
   (:class:`RankResult`: rank, node, exit code, pid, log path). The supervisor decides the job's outcome
   from these alone: any ``EXIT_PREEMPTED`` (75) -> preempted/requeued; all 0 -> succeeded; otherwise
   failed with the exit code of the rank that failed first (``ended_at``), whose log tail ``job show`` prints.

Per-rank records are written by the rank runner (``python -m azulite.launch.local.rank``, see
``rank.py``): it wraps the user's command for ONE rank, tees its output to ``ctx.rank_log(rank)`` and
writes ``ctx.rank_record(rank)`` (JSON: rank, node, local_rank, pid, exit_code, started_at, ended_at) when
it starts and when the command ends. A strategy that puts the rank runner in front of each rank's command
gets :func:`collect_rank_records` for free as its ``collect``; that is what the pytorch strategy does::

    argv = [python, "-m", "azulite.launch.local.rank", "--records", str(ctx.records_dir),
            "--logs", str(ctx.logs_dir), "--", *command_argv(ctx.command)]

:func:`command_argv` runs a simple command (``python train.py --lr 0.1``) directly, without a shell in
between, and one with shell syntax through ``/bin/sh -c`` with a trap that keeps the shell waiting for the
script on SIGTERM (a bare shell dies of it and reports 143 instead of the script's 75).

The rank runner reads the rank numbers from env: RANK/LOCAL_RANK/NODE_RANK (pytorch; set by torchrun,
NODE_RANK derived from GROUP_RANK), or ``AZULITE_RANK``/``AZULITE_LOCAL_RANK``/``AZULITE_NODE_RANK`` which
a strategy may set explicitly (tensorflow: the worker index), or OMPI_COMM_WORLD_RANK / _LOCAL_RANK /
_NODE_RANK (mpirun). So a tensorflow strategy writes one ProcessSpec per worker whose ``env`` holds
``tensorflow_env(...)`` from :mod:`azulite.launch.env` plus ``AZULITE_RANK=i``, and an mpi strategy one
ProcessSpec running ``mpirun ... python -m azulite.launch.local.rank ... -- /bin/sh -c CMD``.

Register a strategy with :func:`register_strategy` in its own module (``tensorflow.py``, ``mpi.py``) and
add the module name to ``_STRATEGY_MODULES`` below; :func:`get_strategy` imports it lazily.
"""

from __future__ import annotations

import importlib
import json
import shlex
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Mapping

from azulite.contract import SHELL_STOP_TRAP
from azulite.errors import LaunchError

if TYPE_CHECKING:  # the spec is data handed in; strategies only read it
    from azulite.spec.job import JobSpec


@dataclass(frozen=True)
class LaunchContext:
    """Everything a strategy needs to start one attempt; built by the supervisor (and by submit for
    preflight). All paths are absolute and exist (except records/logs, created before ``processes``)."""

    job_id: str
    attempt: int  # 1-based
    spec: "JobSpec"  # validated, paths resolved to absolute
    command: str  # the spec's command with ${{inputs.*}}/${{outputs.*}} substituted: run it with /bin/sh -c
    python: str  # the interpreter to run agents / rank runners with (sys.executable of the supervisor)
    attempt_dir: Path  # <job_dir>/attempt-<n>
    node_dirs: tuple[Path, ...]  # one working directory per simulated node (a copy of the code snapshot)
    base_env: Mapping[str, str]  # env every process starts from: PATH with the venv, environment_variables,
    #                              AZULITE_JOB_ID, AZULITE_ATTEMPT, PYTHONUNBUFFERED=1
    rdzv_port: int | None = None  # a port pinned by the user (environment_variables.MASTER_PORT), else None
    gpus: tuple[str, ...] = ()  # visible GPU ids on this machine ("0", "1", ...); empty on CPU

    @property
    def records_dir(self) -> Path:
        return self.attempt_dir / "ranks"

    @property
    def logs_dir(self) -> Path:
        return self.attempt_dir / "logs"

    def rank_log(self, rank: int) -> Path:
        return self.logs_dir / f"rank-{rank}.log"

    def rank_record(self, rank: int) -> Path:
        return self.records_dir / f"rank-{rank}.json"

    def process_log(self, name: str) -> Path:
        """Log of a started process (agent/worker/mpirun) itself: ``logs/<name>.log``."""
        return self.logs_dir / f"{name}.log"

    @property
    def nodes(self) -> int:
        return len(self.node_dirs)


@dataclass(frozen=True)
class ProcessSpec:
    """One OS process the supervisor starts (a torchrun agent, a TF worker, mpirun)."""

    name: str  # unique within the attempt: "node-0", "worker-1", "mpirun"
    node: int  # simulated node index it belongs to
    argv: tuple[str, ...]
    env: Mapping[str, str]  # the COMPLETE environment (start from ctx.base_env)
    cwd: Path
    log: Path  # stdout+stderr of this process (ctx.process_log(name))


@dataclass(frozen=True)
class RankResult:
    """How one rank ended. ``exit_code`` follows the shell: 128+N for a signal N; None if unknown
    (the rank never started or was SIGKILLed before recording)."""

    rank: int
    node: int
    local_rank: int
    exit_code: int | None
    pid: int | None = None
    log: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    restarts: int = 0
    extra: dict = field(default_factory=dict)


class LaunchStrategy(ABC):
    """Starts the processes of one attempt for one distribution type. Stateless: one instance serves
    every job; all per-attempt facts come in the :class:`LaunchContext`."""

    #: the ``distribution.type`` this strategy handles (lower case)
    distribution_type: ClassVar[str]

    def preflight(self, ctx: LaunchContext) -> None:
        """Raise LaunchError (what, where, fix) if the attempt cannot start. Default: nothing to check."""

    @abstractmethod
    def processes(self, ctx: LaunchContext) -> list[ProcessSpec]:
        """The processes to start for this attempt, in start order."""

    def stop_groups(self, ctx: LaunchContext, launchers: Mapping[str, int]) -> list[int]:
        """The process groups a stop notice (``job preempt``'s SIGTERM) goes to, each once, so that every
        process of a rank gets it exactly once (a second one may land after a script's handler returned, and
        turn its exit 75 into 143). ``launchers``: the running processes this strategy started, by name (the
        supervisor starts each in its own session, so each leads its group).

        Default: the launchers' groups. A torchrun agent's group is torchrun alone (it starts each worker in
        a new session): it stops restarting and passes the signal to every worker's group (``killpg``), which
        holds the rank runner and its command; a rank runner started directly shares its group with its
        command. The rank runner itself passes nothing on."""
        return list(launchers.values())

    def world_size(self, ctx: LaunchContext) -> int:
        """How many ranks the attempt has (``job show`` lists them before they start)."""
        return ctx.nodes

    def collect(self, ctx: LaunchContext, process_exits: Mapping[str, int | None]) -> list[RankResult]:
        """Per-rank results once every process ended. ``process_exits`` maps ProcessSpec.name to its exit
        code (shell convention). Default: the rank runner's records, see :func:`collect_rank_records`."""
        return collect_rank_records(ctx, self.world_size(ctx), process_exits)


_SHELL_SYNTAX = set("|&;<>()$`*?[]{}~\n\\'\"#")


def command_argv(command: str) -> list[str]:
    """argv for the user's command: split and run directly when it is one simple command; through
    ``/bin/sh -c`` when it uses shell syntax (pipes, ``&&``, variables, globs, ``VAR=x cmd``), after
    :data:`~azulite.contract.SHELL_STOP_TRAP`, so that on a stop the shell waits for the script and exits
    with its code (75) instead of dying first (143)."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = []
    simple = words and not (set(command) & _SHELL_SYNTAX) and "=" not in words[0]
    return words if simple else ["/bin/sh", "-c", SHELL_STOP_TRAP + command]


def read_rank_records(records_dir: Path) -> dict[int, dict]:
    """The rank runner's JSON records by rank (partial writes are impossible: they are renamed into place)."""
    out: dict[int, dict] = {}
    if not records_dir.is_dir():
        return out
    for p in sorted(records_dir.glob("rank-*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        out[int(rec["rank"])] = rec
    return out


def collect_rank_records(
    ctx: LaunchContext, world_size: int, process_exits: Mapping[str, int | None]
) -> list[RankResult]:
    """RankResults from the rank runner's records; a rank without an exit record gets None (unknown)."""
    recs = read_rank_records(ctx.records_dir)
    results = []
    for rank in range(max(world_size, max(recs, default=-1) + 1)):
        rec = recs.get(rank)
        if rec is None:
            results.append(RankResult(rank=rank, node=-1, local_rank=-1, exit_code=None, log=str(ctx.rank_log(rank))))
            continue
        results.append(
            RankResult(
                rank=rank,
                node=int(rec.get("node_rank", -1)),
                local_rank=int(rec.get("local_rank", -1)),
                exit_code=rec.get("exit_code"),
                pid=rec.get("child_pid") or rec.get("pid"),
                log=rec.get("log") or str(ctx.rank_log(rank)),
                started_at=rec.get("started_at"),
                ended_at=rec.get("ended_at"),
                restarts=int(rec.get("restart", 0)),
            )
        )
    return results


_STRATEGIES: dict[str, LaunchStrategy] = {}
#: modules that register a strategy when imported (lazily, so a missing optional tool costs nothing)
_STRATEGY_MODULES = {
    "none": "azulite.launch.local.single",
    "pytorch": "azulite.launch.local.pytorch",
    "tensorflow": "azulite.launch.local.tensorflow",
    "mpi": "azulite.launch.local.mpi",
}


def register_strategy(cls: type[LaunchStrategy]) -> type[LaunchStrategy]:
    """Class decorator: registers one instance for ``cls.distribution_type``; refuses duplicates."""
    key = cls.distribution_type.lower()
    if key in _STRATEGIES:
        raise ValueError(f"a launch strategy for {key!r} is already registered: {type(_STRATEGIES[key]).__name__}")
    _STRATEGIES[key] = cls()
    return cls


def get_strategy(distribution_type: str) -> LaunchStrategy:
    key = distribution_type.lower()
    if key not in _STRATEGIES and key in _STRATEGY_MODULES:
        try:
            importlib.import_module(_STRATEGY_MODULES[key])
        except ModuleNotFoundError as exc:
            if exc.name != _STRATEGY_MODULES[key]:
                raise
    if key not in _STRATEGIES:
        raise LaunchError(
            f"the local backend cannot run distribution type {distribution_type!r} yet",
            where="distribution.type",
            fix=f"use one of: {', '.join(sorted(_STRATEGY_MODULES))}",
        )
    return _STRATEGIES[key]


