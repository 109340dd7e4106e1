"""Jobs without ``distribution``: the command runs once per node, as independent processes.

What azulite chose for Azure ML's plain command job (see README, "Jobs without distribution"): a command
job with no ``distribution`` gets no distributed launcher, so no process group contract is set up —
no MASTER_ADDR/MASTER_PORT, RANK or WORLD_SIZE — and the command runs once on each of the job's
``instance_count`` nodes (one process per node, the node's whole GPU set). Each process sees
``AZUREML_NODE_COUNT`` and azulite's own ``AZULITE_RANK`` (= its node index, which lines up its log, pid
and exit code with the other strategies). One node is the common case: a single process, as a script run
by hand.
"""

from __future__ import annotations

from azulite.launch.local.strategy import LaunchContext, LaunchStrategy, ProcessSpec, command_argv, register_strategy


@register_strategy
class NoDistributionStrategy(LaunchStrategy):
    distribution_type = "none"

    def processes(self, ctx: LaunchContext) -> list[ProcessSpec]:
        out = []
        per_node = max(1, len(ctx.gpus) // ctx.nodes) if ctx.gpus else 0
        for node, cwd in enumerate(ctx.node_dirs):
            env = {**ctx.base_env, "AZULITE_RANK": str(node), "AZULITE_LOCAL_RANK": "0",
                   "AZULITE_NODE_RANK": str(node), "AZUREML_NODE_COUNT": str(ctx.nodes)}
            env.setdefault("OMP_NUM_THREADS", "1")
            if per_node and ctx.nodes > 1:  # simulated nodes share this machine's GPUs out
                env["CUDA_VISIBLE_DEVICES"] = ",".join(ctx.gpus[(node * per_node + i) % len(ctx.gpus)] for i in range(per_node))
            argv = (ctx.python, "-m", "azulite.launch.local.rank", "--records", str(ctx.records_dir),
                    "--logs", str(ctx.logs_dir), "--", *command_argv(ctx.command))
            name = f"node-{node}"
            out.append(ProcessSpec(name=name, node=node, argv=argv, env=env, cwd=cwd, log=ctx.process_log(name)))
        return out
