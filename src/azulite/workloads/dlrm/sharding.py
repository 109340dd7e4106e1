"""Where DLRM's tables go: memory checks before any process group, TorchRec's planner, and the
DistributedModelParallel wrapper set up for bitwise resume.

TorchRec's planner chooses per table among the sharding types allowed here, with each rank's storage
taken from this machine's real memory. On CPU (gloo) TorchRec supports table_wise, column_wise and
data_parallel; row_wise (and table_row_wise) need CUDA in torchrec 1.8, so they are offered only when the
job runs on GPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import psutil
import torch

from azulite.data.criteo import CAT_FEATURE_NAMES
from azulite.errors import ModelConfigError
from azulite.workloads.dlrm.model import DLRMConfig

log = logging.getLogger(__name__)

CPU_SHARDING_TYPES = ("table_wise", "column_wise", "data_parallel")
GPU_SHARDING_TYPES = (*CPU_SHARDING_TYPES, "row_wise", "table_row_wise")
#: fp32 words of state per embedding row beyond the weights: row-wise Adagrad keeps one per row, so this
#: is generous for it; gradients of data_parallel tables add one more copy, counted by the planner
_HEADROOM = 1.25


def ranks_on_this_host(environ: Mapping[str, str]) -> int:
    """Processes of this job sharing this machine's memory. torchrun's LOCAL_WORLD_SIZE counts one node;
    azulite's local backend runs every simulated node on this one machine (AZUREML_NODE_COUNT nodes)."""
    local = int(environ.get("LOCAL_WORLD_SIZE") or 1)
    if environ.get("AZULITE_JOB_ID") and environ.get("AZUREML_NODE_COUNT"):
        return max(int(environ.get("WORLD_SIZE") or local), local)
    return local


def check_fits(cfg: DLRMConfig, *, world_size: int, ranks_here: int, available_bytes: int | None = None) -> int:
    """Raise before any process group starts when the tables cannot fit in this machine's memory.
    Returns the bytes each rank may use for tables (the planner's storage constraint)."""
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    per_rank = int(available * 0.8) // max(ranks_here, 1)  # leave a fifth for activations, data, the OS
    need = int(cfg.table_bytes() * _HEADROOM)
    capacity = per_rank * world_size
    if need > capacity:
        gb = 1024**3
        raise ModelConfigError(
            f"the embedding tables need {need / gb:.1f} GiB (fp32, {sum(cfg.num_embeddings_per_feature):,} rows x "
            f"{cfg.embedding_dim} with optimizer state) but {world_size} rank(s) have {capacity / gb:.1f} GiB "
            f"({per_rank / gb:.1f} GiB each: {available / gb:.1f} GiB available on this machine, "
            f"{ranks_here} rank(s) here)",
            where="--num_embeddings_per_feature",
            fix="scale the tables down (smaller --num_embeddings_per_feature or --embedding_dim) or run on "
                "more/larger nodes")
    return per_rank


def sharding_types(device: torch.device, allowed: Sequence[str] | None = None) -> list[str]:
    """The sharding types the planner may choose from on ``device``; asking for row_wise on CPU is an error."""
    supported = GPU_SHARDING_TYPES if device.type == "cuda" else CPU_SHARDING_TYPES
    if allowed is None:
        return list(supported)
    bad = [t for t in allowed if t not in supported]
    if bad:
        raise ModelConfigError(
            f"sharding type(s) {', '.join(bad)} are not supported on {device.type}"
            + (" (TorchRec's row_wise sharding needs CUDA)" if device.type == "cpu" else ""),
            where="--sharding_types", fix=f"choose among {', '.join(supported)}")
    return list(allowed)


def shard(model: torch.nn.Module, *, pg: torch.distributed.ProcessGroup, device: torch.device, world_size: int,
          local_world_size: int, batch_size: int, per_rank_bytes: int,
          allowed: Sequence[str] | None = None) -> torch.nn.Module:
    """Plan (rank 0 plans, every rank gets the same plan) and wrap ``model`` (built on meta) in DMP.

    The dense part goes into DDP with ``static_graph=False, find_unused_parameters=True``: TorchRec's
    default ``static_graph=True`` makes DDP rebuild its gradient buckets after the first step whatever
    ``find_unused_parameters`` says, so a resumed run's first step would sum gradients over 3+ ranks in
    another order than the uninterrupted run did and the parameters would differ in the last bit."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    types = sharding_types(device, allowed)
    cuda = device.type == "cuda"
    topology = Topology(world_size=world_size, local_world_size=local_world_size,
                        compute_device="cuda" if cuda else "cpu",
                        ddr_cap=per_rank_bytes,
                        hbm_cap=torch.cuda.get_device_properties(device).total_memory if cuda else None)
    constraints = {f"t_{name}": ParameterConstraints(sharding_types=types) for name in CAT_FEATURE_NAMES}
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints)
    sharders = [EmbeddingBagCollectionSharder()]
    plan = planner.collective_plan(model, sharders, pg)
    chosen = {}
    for _module, params in plan.plan.items():
        for table, ps in params.items():
            chosen[table] = ps.sharding_type
    counts = {t: sum(1 for v in chosen.values() if v == t) for t in sorted(set(chosen.values()))}
    log.info("sharding plan: %s", ", ".join(f"{n} {t}" for t, n in counts.items()))
    return DistributedModelParallel(
        module=model, device=device, plan=plan, sharders=sharders,
        data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=False, find_unused_parameters=True),
    )


def sharding_summary(model: torch.nn.Module) -> dict[str, str]:
    """table -> sharding type of a DMP model (for logs and tests)."""
    out = {}
    for _module, params in model.plan.plan.items():  # type: ignore[union-attr]
        for table, ps in params.items():
            out[table] = ps.sharding_type
    return out
