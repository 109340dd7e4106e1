"""What a rendered manifest needs to know about a VM size: GPUs (the ``nvidia.com/gpu`` limit and the
processes a node may run), RAM (the ``/dev/shm`` size) and InfiniBand (NCCL/UCX settings).

The facts come from the shared SKU catalog (``azulite.catalog``); this module only turns them into the
settings of seeds 001 §1.5 and 002 ("Environment Variables"), and checks a job against them before
anything is rendered.
"""

from __future__ import annotations

from dataclasses import dataclass

from azulite.errors import DeployError


@dataclass(frozen=True)
class SkuFacts:
    name: str
    gpus: int
    ram_gb: float
    infiniband: bool
    vcpus: int = 0


def sku_facts(name: str | None, *, field: str = "resources.instance_type",
              needed_for: str = "a cluster target needs one to size GPUs, /dev/shm and the network",
              example: str = "Standard_NC24rs_v3") -> SkuFacts:
    """The catalog's facts for ``name``; an unknown SKU is the catalog's own error, placed at ``field``.
    ``needed_for``: why a VM size is needed, said when there is none."""
    if not name:
        raise DeployError(f"no VM size: {needed_for}", where=field,
                          fix=f"set {field}, e.g. {example} (`azulite catalog` lists them)")
    from azulite.catalog import get_sku  # the shared catalog: SKUs as dated, sourced data
    from azulite.errors import UnknownSku

    try:
        sku = get_sku(name)
    except UnknownSku as e:
        e.where = field
        raise
    if retired := sku.retirement():  # AKS cannot add such nodes, nor Azure ML such compute: never placed
        raise DeployError(retired, where=field,
                          fix="pick a current VM size (`azulite catalog --sources` lists them, and names the notice)")
    if sku.cloud != "azure":
        raise DeployError(f"{sku.name} is a {sku.cloud} instance type; AKS and Azure ML run Azure VM sizes", where=field,
                          fix="pick an Azure VM size (`azulite catalog` lists them)")
    return SkuFacts(name=sku.name, gpus=int(sku.gpus), ram_gb=float(sku.ram_gb),
                    infiniband=bool(sku.infiniband_gbps), vcpus=int(sku.vcpus))


#: the kubelet's hard eviction threshold on AKS (memory.available<100Mi): never allocatable
AKS_EVICTION_MIB = 100
#: pods per node assumed for AKS's memory reservation: the Azure CLI's default (Azure CNI's is 30, its maximum 250)
AKS_MAX_PODS = 110


def aks_reserved_cpu_millicores(vcpus: int) -> int:
    """AKS's kube-reserved CPU (learn.microsoft.com/azure/aks/node-resource-reservations: 60, 100, 140, 180,
    260, 420, 740 millicores at 1, 2, 4, 8, 16, 32, 64 cores): linear between those points, and 10m a core
    above 4 cores as the table grows (64 cores: 740m)."""
    if vcpus <= 1:
        return 60
    if vcpus <= 2:
        return 60 + 40 * (vcpus - 1)
    if vcpus <= 4:
        return 100 + 20 * (vcpus - 2)
    return 140 + 10 * (vcpus - 4)


def aks_allocatable(sku: SkuFacts) -> tuple[int, int]:
    """(millicores, bytes) a pod may request on one AKS node of ``sku``: the VM's vCPUs and RAM (GiB, as
    Azure lists them) less AKS's reservations (AKS 1.29 and later: kube-reserved memory is the lesser of
    20 MB per pod (``AKS_MAX_PODS``) + 50 MB and 25% of the RAM, plus the 100Mi eviction threshold).
    DaemonSets (kube-proxy, the CNI, the device plugin) take their requests from this too."""
    ram = int(sku.ram_gb * 2**30)
    kube_reserved = min((20 * AKS_MAX_PODS + 50) * 2**20, ram // 4)
    return (sku.vcpus * 1000 - aks_reserved_cpu_millicores(sku.vcpus),
            ram - kube_reserved - AKS_EVICTION_MIB * 2**20)


def nccl_env(sku: SkuFacts) -> dict[str, str]:
    """NCCL/UCX settings for ``sku``: InfiniBand over the mlx5 HCAs where the VM has it (seed 002's
    "Optimal NCCL settings for Azure InfiniBand"), plain sockets on eth0 elsewhere. A CPU VM with InfiniBand
    (HPC sizes, for MPI jobs) has no NCCL to set: UCX over the HCA, and shared memory within the node."""
    if sku.infiniband and not sku.gpus:
        return {"UCX_TLS": "rc,sm,self", "UCX_NET_DEVICES": "mlx5_ib0:1"}
    if sku.infiniband:
        return {
            "NCCL_DEBUG": "INFO",
            "NCCL_IB_DISABLE": "0",
            "NCCL_IB_HCA": "mlx5",
            "NCCL_SOCKET_IFNAME": "eth0",
            "NCCL_IB_TIMEOUT": "22",
            "UCX_TLS": "rc,cuda_copy,cuda_ipc",
            "UCX_NET_DEVICES": "mlx5_ib0:1",
        }
    return {"NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0", "UCX_TLS": "tcp"}


def check_processes(processes: int, sku: SkuFacts, *, field: str = "distribution.process_count_per_instance") -> None:
    """One process per GPU: asking for more processes than the VM has GPUs cannot be scheduled."""
    if sku.gpus and processes > sku.gpus:
        raise DeployError(
            f"{processes} processes per instance but {sku.name} has {sku.gpus} GPU(s)",
            where=field, fix=f"set {field} to at most {sku.gpus}, or pick a VM size with more GPUs",
        )


def shm_size(sku: SkuFacts, requested: str | None) -> str:
    """The ``/dev/shm`` memory emptyDir's size: the spec's ``resources.shm_size``, else half the VM's RAM
    capped at seed 002's 64Gi (a memory emptyDir counts against the pod's memory)."""
    if requested:
        return requested
    return f"{max(1, min(64, int(sku.ram_gb // 2)))}Gi"
