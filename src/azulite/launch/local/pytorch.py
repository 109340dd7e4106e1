"""The pytorch launch strategy (the reference one): ``instance_count`` torchrun agents, one per simulated
node, joined by c10d rendezvous on loopback under one shared ``--rdzv-id``.

Each agent runs ``process_count_per_instance`` workers; each worker is the rank runner
(``azulite.launch.local.rank``) in front of the user's command, which records the rank's pid, log and
exit code. Settings that make multi-agent runs on one box reliable (see FIELD-NOTES):
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (else elastic restarts fail or hang about half the time),
``GLOO_SOCKET_IFNAME=lo`` and ``--local-addr 127.0.0.1`` (MASTER_ADDR on loopback). DeepSpeed jobs are
pytorch jobs too: the deepspeed engine reads the same env contract.
"""

from __future__ import annotations

from azulite.errors import LaunchError
from azulite.launch.local.procs import free_port, port_in_use, port_owner
from azulite.launch.local.strategy import command_argv, LaunchContext, LaunchStrategy, ProcessSpec, register_strategy


def gpu_split(gpus: tuple[str, ...], node: int, per_node: int) -> str | None:
    """CUDA_VISIBLE_DEVICES for one simulated node: its own ``per_node`` GPUs, wrapping around when the
    machine has fewer GPUs than the job asks for; None on a CPU-only machine."""
    if not gpus:
        return None
    return ",".join(gpus[(node * per_node + i) % len(gpus)] for i in range(per_node))


#: an elastic round re-forms without a lost node once its heartbeats are missed (2 s x 3) and closes 3 s
#: after min_nodes joined; torchrun's defaults (5 s x 3, then 30 s) left a survivor idle about 46 s
#: (FIELD-NOTES). A node that comes back joins the waiting list; the running agents restart into a round
#: with it (torchrun's own scale-up).
_ELASTIC_RDZV = ",last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=3"


@register_strategy
class PyTorchStrategy(LaunchStrategy):
    distribution_type = "pytorch"

    def preflight(self, ctx: LaunchContext) -> None:
        port = ctx.rdzv_port
        if port is not None and port_in_use(port):
            owner = port_owner(port)
            raise LaunchError(
                f"rendezvous port {port} on 127.0.0.1 is already in use" + (f" by {owner}" if owner else ""),
                where="environment_variables.MASTER_PORT",
                fix="stop what holds it, pick another port, or remove MASTER_PORT to let azulite choose a free one",
            )

    def world_size(self, ctx: LaunchContext) -> int:
        return ctx.nodes * ctx.spec.processes_per_node

    def processes(self, ctx: LaunchContext) -> list[ProcessSpec]:
        spec = ctx.spec
        per_node = spec.processes_per_node
        port = ctx.rdzv_port or free_port()
        backend_env = {
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "GLOO_SOCKET_IFNAME": "lo",
        }
        out = []
        for node, cwd in enumerate(ctx.node_dirs):
            env = {**backend_env, **ctx.base_env}
            env.setdefault("OMP_NUM_THREADS", "1")
            visible = gpu_split(ctx.gpus, node, per_node)
            if visible is not None:
                env["CUDA_VISIBLE_DEVICES"] = visible
            argv = (
                ctx.python, "-m", "torch.distributed.run",
                # a fixed count, or the spec's elastic range (MIN:MAX: the group re-forms on the nodes left)
                "--nnodes={}:{}".format(*spec.node_range) if spec.elastic else f"--nnodes={ctx.nodes}",
                f"--nproc-per-node={per_node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id={ctx.job_id}-a{ctx.attempt}",
                # node 0 hosts the rendezvous store, the others connect: without this every agent on
                # 127.0.0.1 believes it is the host, and one whose bind fails silently becomes a client
                # of whatever holds the port (a hang instead of an error)
                f"--rdzv-conf=is_host={1 if node == 0 else 0}" + (_ELASTIC_RDZV if spec.elastic else ""),
                f"--max-restarts={spec.max_restarts}",
                "--local-addr=127.0.0.1",
                f"--log-dir={ctx.attempt_dir / 'torchelastic' / f'node-{node}'}",
                "--no-python",
                "--",  # everything after is the worker command: torchrun must not parse it
                ctx.python, "-m", "azulite.launch.local.rank",
                "--records", str(ctx.records_dir), "--logs", str(ctx.logs_dir),
                "--", *command_argv(ctx.command),
            )
            name = f"node-{node}"
            out.append(ProcessSpec(name=name, node=node, argv=argv, env=env, cwd=cwd, log=ctx.process_log(name)))
        return out
