"""The distributed environment contract: exactly the variables Azure ML sets for each process of a job
(seed 001 §1.2-1.4), as pure functions. Every backend computes the env from here, so a training script
reads the same names on this machine, on AKS and on Azure ML.

- pytorch (§1.2): MASTER_ADDR (the rank-0 host), MASTER_PORT (a free port on it), WORLD_SIZE (all
  processes), RANK (global), LOCAL_RANK (within the node), NODE_RANK (the node's index); plus the node
  count as AZUREML_NODE_COUNT (what Azure ML sets) and NNODES / LOCAL_WORLD_SIZE (torchrun's names).
- tensorflow (§1.4): TF_CONFIG = {"cluster": {"worker": [...], "ps": [...]}, "task": {"type", "index"},
  "environment": "cloud"}.
- mpi: the Open MPI rank variables OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE /
  _NODE_RANK (what mpirun sets and Azure ML's MPI distribution relies on), plus AZ_BATCH_MASTER_NODE
  style MASTER_ADDR/MASTER_PORT for frameworks initialised from env on top of MPI.
"""

from __future__ import annotations

import json
from typing import Mapping, Sequence


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def pytorch_env(
    *,
    master_addr: str,
    master_port: int,
    node_rank: int,
    nnodes: int,
    nproc_per_node: int,
    local_rank: int,
) -> dict[str, str]:
    """Env for one process of a pytorch job: global rank = node_rank * nproc_per_node + local_rank."""
    _check_counts(node_rank=node_rank, local_rank=local_rank)
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nnodes and nproc_per_node must be >= 1, got {nnodes} and {nproc_per_node}")
    if node_rank >= nnodes or local_rank >= nproc_per_node:
        raise ValueError(f"node_rank {node_rank}/{nnodes} or local_rank {local_rank}/{nproc_per_node} out of range")
    world = nnodes * nproc_per_node
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(world),
        "RANK": str(node_rank * nproc_per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "NODE_RANK": str(node_rank),
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
        "NNODES": str(nnodes),
        "AZUREML_NODE_COUNT": str(nnodes),
    }


def pytorch_env_from_torchrun(environ: Mapping[str, str]) -> dict[str, str]:
    """The Azure ML names a torchrun worker lacks, from what torchrun did set: NODE_RANK is torchrun's
    GROUP_RANK (c10d assigns group ranks at rendezvous), NNODES / AZUREML_NODE_COUNT is
    WORLD_SIZE / LOCAL_WORLD_SIZE. Pure: reads only ``environ``."""
    out: dict[str, str] = {}
    if "GROUP_RANK" in environ:
        out["NODE_RANK"] = environ["GROUP_RANK"]
    if "WORLD_SIZE" in environ and "LOCAL_WORLD_SIZE" in environ:
        nnodes = int(environ["WORLD_SIZE"]) // max(1, int(environ["LOCAL_WORLD_SIZE"]))
        out["NNODES"] = str(nnodes)
        out["AZUREML_NODE_COUNT"] = str(nnodes)
    return out


def tf_config(
    *,
    workers: Sequence[str],
    task_type: str,
    task_index: int,
    parameter_servers: Sequence[str] = (),
) -> dict:
    """The TF_CONFIG object (not yet JSON). ``workers``/``parameter_servers`` are "host:port" strings."""
    if not workers:
        raise ValueError("a tensorflow job needs at least one worker")
    if task_type not in ("worker", "ps", "chief", "evaluator"):
        raise ValueError(f"unknown TF task type {task_type!r}")
    pool = {"worker": workers, "ps": parameter_servers}.get(task_type)
    if pool is not None and not 0 <= task_index < len(pool):
        raise ValueError(f"task index {task_index} out of range for {len(pool)} {task_type}(s)")
    cluster: dict[str, list[str]] = {"worker": list(workers)}
    if parameter_servers:
        cluster["ps"] = list(parameter_servers)
    return {"cluster": cluster, "task": {"type": task_type, "index": task_index}, "environment": "cloud"}


def tensorflow_env(
    *,
    workers: Sequence[str],
    task_type: str,
    task_index: int,
    parameter_servers: Sequence[str] = (),
) -> dict[str, str]:
    """Env for one TF process: TF_CONFIG as JSON (seed §1.4), and the worker's index as RANK-like
    AZULITE_RANK so per-rank logs and exit codes line up with the other distributions."""
    cfg = tf_config(workers=workers, task_type=task_type, task_index=task_index, parameter_servers=parameter_servers)
    env = {"TF_CONFIG": json.dumps(cfg)}
    if task_type == "worker":
        env["AZULITE_RANK"] = str(task_index)
    return env


def mpi_env(*, world_size: int, rank: int, local_rank: int, local_size: int, node_rank: int) -> dict[str, str]:
    """The Open MPI variables one rank sees (mpirun sets them itself; this is what a backend that starts
    ranks without mpirun — Kubernetes MPIJob workers, tests — must reproduce)."""
    if not (0 <= rank < world_size and 0 <= local_rank < local_size):
        raise ValueError(f"rank {rank}/{world_size} or local_rank {local_rank}/{local_size} out of range")
    return {
        "OMPI_COMM_WORLD_SIZE": str(world_size),
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_COMM_WORLD_NODE_RANK": str(node_rank),
        "PMIX_RANK": str(rank),
    }


def rank_identity(environ: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(rank, local_rank, node_rank) of the current process from whichever contract started it:
    azulite's explicit AZULITE_RANK, torchrun/Azure ML pytorch names, or Open MPI's. None if none is set."""
    if "AZULITE_RANK" in environ:
        return (
            int(environ["AZULITE_RANK"]),
            int(environ.get("AZULITE_LOCAL_RANK", "0")),
            int(environ.get("AZULITE_NODE_RANK", environ["AZULITE_RANK"])),
        )
    if "RANK" in environ:
        node = environ.get("NODE_RANK", environ.get("GROUP_RANK", "0"))
        return int(environ["RANK"]), int(environ.get("LOCAL_RANK", "0")), int(node)
    if "OMPI_COMM_WORLD_RANK" in environ:
        return (
            int(environ["OMPI_COMM_WORLD_RANK"]),
            int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),
            int(environ.get("OMPI_COMM_WORLD_NODE_RANK", "0")),
        )
    return None


#: what each distribution's launcher sets for every process (torchrun with the rank runner, TF_CONFIG,
#: mpirun): a job's own ``environment_variables`` value for one of these never reaches its processes
_OWNED = {
    "pytorch": ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_NAME", "ROLE_WORLD_SIZE", "NODE_RANK", "NNODES", "AZUREML_NODE_COUNT", "MASTER_ADDR"),
    "tensorflow": ("TF_CONFIG",),
    "mpi": ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
            "OMPI_COMM_WORLD_NODE_RANK", "PMIX_RANK"),
    "none": ("AZUREML_NODE_COUNT",),
}
#: set for every process of every job (azulite's rank identity and bookkeeping)
_OWNED_ALWAYS = ("AZULITE_RANK", "AZULITE_LOCAL_RANK", "AZULITE_NODE_RANK", "AZULITE_JOB_ID", "AZULITE_ATTEMPT",
                 "AZULITE_JOB_DIR", "PYTHONUNBUFFERED")


def overridden_variables(names: Sequence[str], distribution_type: str, inputs: Sequence[str] = (),
                         outputs: Sequence[str] = ()) -> list[str]:
    """Of a job's ``environment_variables`` ``names``, those its launcher and azulite set for every process
    (so the job's own value is replaced): the distribution's contract (RANK, WORLD_SIZE, MASTER_ADDR... for
    pytorch, TF_CONFIG, OMPI_COMM_WORLD_*), azulite's own (AZULITE_RANK...), and the names of the job's data
    (AZULITE_OUTPUT_<NAME>, AZURE_ML_INPUT_<name>, AZURE_ML_OUTPUT_<name>). MASTER_PORT is not among them: a
    pytorch job's pins the rendezvous port (see the README)."""
    owned = set(_OWNED.get(distribution_type, ())) | set(_OWNED_ALWAYS)
    owned |= {f"AZULITE_OUTPUT_{n.upper()}" for n in outputs} | {f"AZURE_ML_OUTPUT_{n}" for n in outputs}
    owned |= {f"AZURE_ML_INPUT_{n}" for n in inputs}
    torchrun = distribution_type == "pytorch"
    return [n for n in names if n in owned or (torchrun and n.startswith("TORCHELASTIC_"))]
