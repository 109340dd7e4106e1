"""The tensorflow launch strategy: one process per worker (and per parameter server), each started with
the TF_CONFIG Azure ML would give it (seed 001 §1.4, :func:`azulite.launch.env.tensorflow_env`).

Workers are ranks: each runs the rank runner (``azulite.launch.local.rank``) in front of the user's command,
with ``AZULITE_RANK`` = the worker index, so per-rank logs, pids and exit codes line up with the other
distributions. Worker ``i`` lives on simulated node ``i % instance_count`` and runs in that node's
working directory. The cluster addresses are free loopback ports taken when the attempt starts.

Parameter servers are not ranks: a TF ps task serves variables until it is killed (``server.join()``), so
it would keep a finished job running forever. Each ps runs under a *ps guard*
(``python -m azulite.launch.local.tensorflow --ps-guard ...``) that ends it once every worker has recorded
its exit, and exits 0; a ps that dies by itself before that fails the job with its own exit code.

Cancellation: a TF worker waiting for its peers may not end on SIGTERM; the supervisor's tree kill sends
SIGKILL after ``kill_grace_s`` (AZULITE_KILL_GRACE_S), which the tests check leaves no process behind.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from azulite.launch.env import tensorflow_env
from azulite.launch.local.procs import free_ports
from azulite.launch.local.strategy import (
    LaunchContext, LaunchStrategy, ProcessSpec, command_argv, read_rank_records, register_strategy,
)

#: how often the ps guard looks at the workers' records
_GUARD_POLL_S = 0.5
#: SIGTERM -> SIGKILL for a ps the guard ends (a ps in server.join() may not end on SIGTERM)
_PS_KILL_GRACE_S = 3.0


@register_strategy
class TensorFlowStrategy(LaunchStrategy):
    distribution_type = "tensorflow"

    @staticmethod
    def _counts(ctx: LaunchContext) -> tuple[int, int]:
        d = ctx.spec.distribution
        return getattr(d, "worker_count", 1), getattr(d, "parameter_server_count", 0)

    def world_size(self, ctx: LaunchContext) -> int:
        return self._counts(ctx)[0]

    def processes(self, ctx: LaunchContext) -> list[ProcessSpec]:
        n_workers, n_ps = self._counts(ctx)
        ports = free_ports(n_workers + n_ps)
        workers = [f"127.0.0.1:{p}" for p in ports[:n_workers]]
        ps = [f"127.0.0.1:{p}" for p in ports[n_workers:]]
        cmd = command_argv(ctx.command)
        out = []
        # parameter servers first: workers connect to them as they start
        for j in range(n_ps):
            node = j % ctx.nodes
            env = {**ctx.base_env, **tensorflow_env(workers=workers, parameter_servers=ps, task_type="ps", task_index=j)}
            argv = (
                ctx.python, "-m", "azulite.launch.local.tensorflow", "--ps-guard",
                "--records", str(ctx.records_dir), "--workers", str(n_workers), "--", *cmd,
            )
            name = f"ps-{j}"
            out.append(ProcessSpec(name=name, node=node, argv=argv, env=env, cwd=ctx.node_dirs[node],
                                   log=ctx.process_log(name)))
        for i in range(n_workers):
            node = i % ctx.nodes
            env = {**ctx.base_env, **tensorflow_env(workers=workers, parameter_servers=ps, task_type="worker", task_index=i)}
            env.update(AZULITE_RANK=str(i), AZULITE_LOCAL_RANK=str(i // ctx.nodes), AZULITE_NODE_RANK=str(node))
            argv = (
                ctx.python, "-m", "azulite.launch.local.rank",
                "--records", str(ctx.records_dir), "--logs", str(ctx.logs_dir), "--", *cmd,
            )
            name = f"worker-{i}"
            out.append(ProcessSpec(name=name, node=node, argv=argv, env=env, cwd=ctx.node_dirs[node],
                                   log=ctx.process_log(name)))
        return out


def _workers_done(records: Path, n_workers: int) -> bool:
    recs = read_rank_records(records)
    return all(recs.get(i, {}).get("exit_code") is not None for i in range(n_workers))


def ps_guard(argv: list[str]) -> int:
    """Run one parameter server until every worker has recorded its exit code, then end it (exit 0).
    If the ps ends first, exit with its code (shell convention)."""
    split = argv.index("--")
    opts, cmd = dict(zip(argv[:split:2], argv[1:split:2])), argv[split + 1:]
    records, n_workers = Path(opts["--records"]), int(opts["--workers"])
    # A stop (preempt) goes to this process group, which the ps shares: not passed on (a second SIGTERM).
    # The guard stays to end a ps that ignores it (server.join()) once the workers are done. (Caught, not
    # ignored: the ps starts with the default action, as exec resets a caught signal and keeps an ignored one.)
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    while proc.poll() is None:
        if _workers_done(records, n_workers):
            print(f"azulite: all {n_workers} worker(s) ended; stopping parameter server", flush=True)
            proc.terminate()
            try:
                proc.wait(_PS_KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return 0
        time.sleep(_GUARD_POLL_S)
    code = proc.returncode
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    if sys.argv[1:2] != ["--ps-guard"] or "--" not in sys.argv:
        print("usage: python -m azulite.launch.local.tensorflow --ps-guard --records DIR --workers N -- CMD...",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(ps_guard(sys.argv[2:]))
