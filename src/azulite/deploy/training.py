"""A job spec as Kubernetes training objects: (a) an Indexed Job + headless Service with torchrun in each
pod and the c10d rendezvous on pod 0 (seed 002 "Option A"), (b) a Kubeflow PyTorchJob with an
``elasticPolicy`` (seed 002 "Option C") over the spec's node range, (c) for a ``tensorflow`` job, a Kubeflow
TFJob: one pod per worker and per parameter server, each with the TF_CONFIG the operator sets. A job without
``distribution`` runs its command itself, one pod per node (the Indexed Job only). An ``mpi`` job is an
MPIJob (``azulite.deploy.mpi_job``, on this module's pod template); ``azulite.deploy.objects`` picks.

All share one pod template: GPU pool nodeSelector/tolerations (``sku=gpu:NoSchedule``; spot pools
``kubernetes.azure.com/scalesetpriority=spot``), ``nvidia.com/gpu`` = processes per instance, ``/dev/shm``
as a memory emptyDir, NCCL/UCX from the SKU, a grace period for the preemption checkpoint, outputs on Blob
(workload identity) or a PVC, and the code either fetched by an init container or baked into the image.

torchrun runs under ``pod_entry.py`` (``agent``, and ``rank`` around each rank), shipped in a ConfigMap
beside the job and mounted at ``/azulite``: so the pod exits 78 when a rank did (the Job fails at once)
and 75 when its ranks checkpointed after an eviction (ignored), which torchrun alone reports as 1. A
command run once per pod runs under the ``agent`` too (as PID 1 it would get no SIGTERM without a handler).
"""

from __future__ import annotations

import re
import shlex
import signal
from pathlib import Path
from typing import Any

from azulite.contract import CHECKPOINT_OUTPUT, EXIT_CONFIG, EXIT_PREEMPTED, SHELL_STOP_TRAP
from azulite.deploy import pod_entry, pod_mpi
from azulite.deploy.image import code_init_container, container_image
from azulite.deploy.options import CODE_DIR, NFS_DIR, PVC_DIR, AksOptions
from azulite.deploy.sku import SkuFacts, check_processes, nccl_env, shm_size, sku_facts
from azulite.errors import DeployError
from azulite.spec.job import JobSpec, PathInput
from azulite.spec.loader import render_command

CONTAINER = "trainer"
PYTORCH_CONTAINER = "pytorch"  # the training operator's admission requires it, and its ExitCode policy reads it
TF_CONTAINER = "tensorflow"  # the same for a TFJob (TFJobDefaultContainerName)
TF_PORT = 2222  # the port TF_CONFIG names for every task (the operator's TFJobDefaultPort, as `tfjob-port`)
GPU_TAINT = {"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}
SPOT_KEY = "kubernetes.azure.com/scalesetpriority"
SPOT_TAINT = {"key": SPOT_KEY, "operator": "Equal", "value": "spot", "effect": "NoSchedule"}
_SHELL = re.compile(r"[;&|<>`$()]|\$\(")
ENTRY_DIR = "/azulite"
ENTRY = f"{ENTRY_DIR}/pod_entry.py"
ENTRY_VOLUME = "azulite-entry"
MARKS_VOLUME = "azulite-marks"
EXIT_RETRYABLE = 128 + signal.SIGTERM  # SIGTERM's exit: one Kubeflow's ExitCode policy retries


def k8s_name(name: str) -> str:
    """A DNS-1035 label from a job name (lowercase, '-' for '_', a letter first: what a Service and the
    training operator's admission ask), at most 52 characters so that ``<name>-<index>`` pod hostnames and
    ``<name>-entry`` stay valid."""
    out = re.sub(r"[^a-z0-9-]", "-", name.lower()).strip("-")
    if out and not out[0].isalpha():
        out = f"job-{out}"
    return out[:52].strip("-") or "job"


def _remote(path: str) -> bool:
    return "://" in path or path.startswith("azureml:")


class PodPlan:
    """Paths as the pod sees them, and the volumes that make them so."""

    def __init__(self, spec: JobSpec, opts: AksOptions) -> None:
        self.spec, self.opts = spec, opts
        self.volumes: list[dict] = []
        self.mounts: list[dict] = []
        self.env: dict[str, str] = {}
        self.uses_blob = False
        self.inputs = {name: self._input(name, v) for name, v in spec.inputs.items()}
        self.outputs = {name: self._output(name, o.path) for name, o in spec.outputs.items()}
        if opts.pvc:
            self.volumes.append({"name": "outputs", "persistentVolumeClaim": {"claimName": opts.pvc}})
            self.mounts.append({"name": "outputs", "mountPath": PVC_DIR})

    def _input(self, name: str, value: Any) -> Any:
        if not isinstance(value, PathInput):
            return value
        path = value.path
        if path.startswith("nfs://"):
            server, _, export = path[len("nfs://"):].partition("/")
            vol = re.sub(r"[^a-z0-9-]", "-", f"{name.lower()}-volume")
            self.volumes.append({"name": vol, "nfs": {"server": server, "path": "/" + export}})
            self.mounts.append({"name": vol, "mountPath": f"{NFS_DIR}/{name}"})
            return value.model_copy(update={"path": f"{NFS_DIR}/{name}"})
        if path.startswith("azureml:"):
            raise DeployError(
                f"input {name!r} is an Azure ML data asset ({path}); a Kubernetes pod cannot read it",
                where=f"inputs.{name}.path", fix="use an az://container/path or nfs://server/export URI, or --target azureml",
            )
        if path.startswith("az://"):
            self.uses_blob = True
            return value
        if _remote(path):
            return value
        try:
            rel = Path(path).resolve().relative_to(Path(self.spec.code).resolve())
        except ValueError:
            raise DeployError(
                f"input {name!r} is a local path outside the code folder ({path}); the pod cannot see it",
                where=f"inputs.{name}.path", fix="move it under the code folder, or upload it and use an az:// URI",
            ) from None
        return value.model_copy(update={"path": f"{CODE_DIR}/{rel}"})

    def _output(self, name: str, path: str | None) -> str:
        if path and path.startswith("az://"):
            self.uses_blob = True
            return path
        if path and _remote(path):
            raise DeployError(f"output {name!r} at {path} cannot be written from a pod", where=f"outputs.{name}.path",
                              fix="use an az://container/dir URI, or leave the path out and pass --pvc CLAIM")
        if not self.opts.pvc:
            raise DeployError(
                f"output {name!r} has no az:// location and no volume to land on: a pod's disk goes with it",
                where=f"outputs.{name}.path",
                fix=f"set outputs.{name}.path to az://container/dir (Blob via workload identity), or pass --pvc CLAIM",
            )
        return f"{PVC_DIR}/outputs/{name}"


def check_job(spec: JobSpec, opts: AksOptions) -> SkuFacts:
    """Everything that must hold before anything is rendered or sent."""
    sku = sku_facts(spec.resources.instance_type)
    check_processes(spec.processes_per_node, sku)
    if spec.resources.docker_args is not None:  # rendered without them, the pod would not be what was asked
        raise DeployError("resources.docker_args has no Kubernetes equivalent (a pod runs no `docker run`)",
                          where="resources.docker_args",
                          fix="remove it for AKS; /dev/shm's size is resources.shm_size, rendered as a memory volume")
    if spec.priority == "spot" and CHECKPOINT_OUTPUT not in spec.outputs:
        raise DeployError(
            "a spot job without a checkpoint location loses its progress at every eviction",
            where=f"outputs.{CHECKPOINT_OUTPUT}",
            fix=f"add `outputs: {{{CHECKPOINT_OUTPUT}: {{path: az://container/dir}}}}` (or pass --pvc) and resume from it",
        )
    return sku


_LAUNCHERS = ("torchrun", "deepspeed")


def rank_command(spec: JobSpec, plan: PodPlan) -> list[str]:
    """The user's command with pod paths substituted, as ``pod_entry.py rank`` options: a ``python X.py``
    command runs X.py with torchrun's interpreter (``--python``, as torchrun runs a script); a
    ``torchrun``/``deepspeed X.py`` command has its launcher dropped (the pod's torchrun already sets the
    env:// contract DeepSpeed reads); anything else (or anything needing a shell) runs as it is."""
    cmd = render_command(spec.command, plan.inputs, plan.outputs)
    if _SHELL.search(cmd):
        return ["--", "bash", "-c", SHELL_STOP_TRAP + cmd]
    argv = shlex.split(cmd)
    if argv and Path(argv[0]).name in ("python", "python3"):
        return ["--python", "--", *argv[1:]]
    if argv and Path(argv[0]).name in _LAUNCHERS:
        # the launcher's own options end at the script (or -m module)
        for i, a in enumerate(argv[1:], 1):
            if a == "-m" or a.endswith(".py"):
                return ["--python", "--", *argv[i:]]
    return ["--", *argv]


def entry_config_map(name: str, opts: AksOptions, spec: JobSpec) -> dict:
    """The ConfigMap holding ``pod_entry.py`` (stdlib only; and for an MPIJob ``pod_mpi.py``, which imports
    it), which every pod of job ``name`` mounts."""
    files = [pod_entry.__file__] + ([pod_mpi.__file__] if spec.distribution_type == "mpi" else [])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**_meta(name, opts, spec), "name": f"{name}-entry"},
            "data": {Path(f).name: Path(f).read_text() for f in files}}


def _plain_command(spec: JobSpec, plan: PodPlan) -> list[str]:
    """``distribution: none``: the user's command itself, once per pod (as once per node locally)."""
    cmd = render_command(spec.command, plan.inputs, plan.outputs)
    return ["bash", "-c", SHELL_STOP_TRAP + cmd] if _SHELL.search(cmd) else shlex.split(cmd)


def job_env(spec: JobSpec, sku: SkuFacts, plan: PodPlan, opts: AksOptions, extra: dict[str, str]) -> list[dict]:
    env = {**nccl_env(sku), **extra, "AZUREML_NODE_COUNT": str(spec.nodes)}
    for name, path in plan.outputs.items():
        env[f"AZULITE_OUTPUT_{name.upper()}"] = path
    if plan.uses_blob and opts.storage_account:
        env["AZURE_STORAGE_ACCOUNT_NAME"] = opts.storage_account
    env.update(spec.environment_variables)  # the user's word wins
    return [{"name": k, "value": v} for k, v in env.items()]


def pod_template(spec: JobSpec, opts: AksOptions, sku: SkuFacts, *, command: list[str], env_extra: dict[str, str],
                 labels: dict[str, str], restart_policy: str, entry_map: str, subdomain: str | None = None,
                 exit_preempted: int = EXIT_PREEMPTED, container_name: str = CONTAINER, gpus: int | None = None,
                 indexed: bool = True, ports: list[dict] | None = None, argv: list[str] | None = None) -> dict:
    """``command`` is the launcher (torchrun) the user's command runs under, empty to run the command itself;
    either under ``pod_entry.py`` from the ConfigMap ``entry_map`` (the pod exits ``exit_preempted`` when
    its ranks checkpointed after a stop). ``gpus``: the container's GPUs when not one per process (torchrun)
    or the node's (a command run once per pod); ``indexed``: an Indexed Job's pod (NODE_RANK from its index);
    ``argv``: the container's whole command instead (an MPIJob's pods run ``pod_mpi.py``)."""
    plan = PodPlan(spec, opts)
    image = container_image(spec, opts)
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(sku, spec.resources.shm_size)}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    init = []
    if opts.code_uri:
        volumes.append({"name": "code", "emptyDir": {}})
        mounts.append({"name": "code", "mountPath": CODE_DIR})
        init.append(code_init_container(opts, k8s_name(spec.name)))
        plan.uses_blob = True
    # the pod entry is the container's process (PID 1): it passes SIGTERM on, reaps orphans, and exits with
    # what the ranks said (under torchrun) or the command's own code (run once per pod)
    volumes.append({"name": ENTRY_VOLUME, "configMap": {"name": entry_map, "defaultMode": 0o555}})
    mounts.append({"name": ENTRY_VOLUME, "mountPath": ENTRY_DIR, "readOnly": True})
    # where its ranks' exit codes go: an emptyDir, not the image's filesystem (the pod sets no readOnlyRootFilesystem:
    # torchrun makes its log folder in /tmp)
    volumes.append({"name": MARKS_VOLUME, "emptyDir": {"sizeLimit": "1Mi"}})
    mounts.append({"name": MARKS_VOLUME, "mountPath": pod_entry.DEFAULT_MARKS})
    agent = ["python3", ENTRY, "agent", *([f"--exit-preempted={exit_preempted}"] if exit_preempted != EXIT_PREEMPTED
                                           else []), "--"]
    if argv is None and command:
        argv = [*agent, *command, ENTRY, "rank", *rank_command(spec, plan)]
    elif argv is None:
        argv = [*agent, *_plain_command(spec, plan)]
    env = job_env(spec, sku, plan, opts, env_extra)
    if not command and indexed:
        # the rank a once-per-node command reads locally (launch/env.py): the Indexed Job's pod index
        env.insert(0, {"name": "NODE_RANK", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}})
    container: dict[str, Any] = {
        "name": container_name,
        "image": image,
        "workingDir": CODE_DIR,
        "command": argv[:1],
        "args": argv[1:],
        "env": env,
        "volumeMounts": plan.mounts + mounts,
    }
    if ports:
        container["ports"] = ports
    if gpus is None and sku.gpus:
        # torchrun: one GPU per process; a bare command (one process per pod) gets the whole node's GPUs
        gpus = spec.processes_per_node if command else sku.gpus
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    node_selector = {"sku": "gpu"} if sku.gpus else {}
    node_selector["node.kubernetes.io/instance-type"] = sku.name
    tolerations = [dict(GPU_TAINT)] if sku.gpus else []
    if spec.priority == "spot":
        node_selector[SPOT_KEY] = "spot"
        tolerations.append(dict(SPOT_TAINT))
    pod: dict[str, Any] = {
        "restartPolicy": restart_policy,
        "terminationGracePeriodSeconds": opts.termination_grace_s,
        "nodeSelector": node_selector,
        "tolerations": tolerations,
        "containers": [container],
        "volumes": plan.volumes + volumes,
    }
    if init:
        pod["initContainers"] = init
    if subdomain:
        pod["subdomain"] = subdomain
    if plan.uses_blob:
        # workload identity: the webhook injects the federated token for this service account's identity
        pod["serviceAccountName"] = opts.service_account
        labels = {**labels, "azure.workload.identity/use": "true"}
    return {"metadata": {"labels": labels}, "spec": pod}


def _meta(name: str, opts: AksOptions, spec: JobSpec) -> dict:
    return {"name": name, "namespace": opts.namespace,
            "labels": {"app.kubernetes.io/managed-by": "azulite", "azulite.io/job": name}}


def indexed_job(spec: JobSpec, opts: AksOptions, name: str | None = None) -> list[dict]:
    """[headless Service, Indexed Job]: pod ``<name>-0.<name>`` hosts the c10d rendezvous."""
    sku = check_job(spec, opts)
    name = name or k8s_name(spec.name)
    selector = {"azulite.io/job": name}
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(name, opts, spec),
        "spec": {"clusterIP": "None", "selector": selector, "publishNotReadyAddresses": True,
                 "ports": [{"name": "c10d", "port": opts.rdzv_port, "targetPort": opts.rdzv_port}]},
    }
    master = f"{name}-0.{name}.{opts.namespace}.svc.cluster.local"
    lo, hi = spec.node_range
    torchrun = [] if spec.distribution_type == "none" else [
        "torchrun", f"--nnodes={lo}:{hi}" if lo != hi else f"--nnodes={hi}", f"--nproc_per_node={spec.processes_per_node}",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=$(MASTER_ADDR):{opts.rdzv_port}", f"--rdzv_id={name}",
        f"--max_restarts={spec.max_restarts}",
    ]
    template = pod_template(spec, opts, sku, command=torchrun, labels=selector, restart_policy="Never", subdomain=name,
                            env_extra={"MASTER_ADDR": master, "MASTER_PORT": str(opts.rdzv_port)},
                            entry_map=f"{name}-entry")
    job_spec: dict[str, Any] = {
        "parallelism": spec.nodes, "completions": spec.nodes, "completionMode": "Indexed",
        "backoffLimit": spec.max_retries,
        # a pod whose ranks checkpointed after SIGTERM (exit 75) or evicted from a spot node is not a failure;
        # a rank that exits 78 (an error no restart can fix) fails the Job at once, backoffLimit left unused
        # (under torchrun, pod_entry.py makes the pod's exit code say so: torchrun alone would exit 1)
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [EXIT_PREEMPTED]}},
            {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [EXIT_CONFIG]}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]},
        "template": template,
    }
    if spec.timeout:
        job_spec["activeDeadlineSeconds"] = int(spec.timeout)
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(name, opts, spec), "spec": job_spec}
    return [service, entry_config_map(name, opts, spec), job]


def pytorch_job(spec: JobSpec, opts: AksOptions, name: str | None = None) -> list[dict]:
    """[PyTorchJob]: the training operator sets the PET_* rendezvous variables torchrun reads."""
    sku = check_job(spec, opts)
    if spec.distribution_type == "none":
        raise DeployError(
            "a PyTorchJob runs torchrun in each worker; this job has no distribution (its command runs once per node)",
            where="distribution", fix="use --flavor indexed-job (one pod per node, the command itself), "
                                      "or set `distribution: {type: pytorch, process_count_per_instance: N}`",
        )
    name = name or k8s_name(spec.name)
    # the operator passes min:max to torchrun as PET_NNODES; (n, n) unless the spec has `elastic`
    lo, hi = spec.node_range
    # Kubeflow's ExitCode policy: a pod that exits 130/137/143/138 (signals: an eviction, a lost node) is
    # recreated, any other code fails the job; so a pod whose ranks checkpointed after SIGTERM exits 143
    # (retried), a rank's 78 fails the job at once, and a failure torchrun's restarts did not fix fails it.
    # The operator counts runPolicy.backoffLimit on in-place container restarts, which ExitCode pods (Never)
    # do not make: the spec's max_retries is added to torchrun's restarts instead (from the last checkpoint)
    template = pod_template(spec, opts, sku, command=["torchrun"], labels={"azulite.io/job": name},
                            restart_policy="Never", env_extra={}, entry_map=f"{name}-entry",
                            exit_preempted=EXIT_RETRYABLE, container_name=PYTORCH_CONTAINER)
    body: dict[str, Any] = {
        "elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": lo, "maxReplicas": hi,
                          "maxRestarts": (spec.max_restarts or 3) + spec.max_retries},
        "nprocPerNode": str(spec.processes_per_node),
        "pytorchReplicaSpecs": {"Worker": {"replicas": spec.nodes, "restartPolicy": "ExitCode", "template": template}},
    }
    return kubeflow_job("PyTorchJob", name, opts, spec, body, clean_pods="None")


def kubeflow_job(kind: str, name: str, opts: AksOptions, spec: JobSpec, body: dict, *, clean_pods: str,
                 api_version: str = "kubeflow.org/v1") -> list[dict]:
    """[the pod entry's ConfigMap, a Kubeflow job of ``kind``]: ``body`` and the runPolicy the kinds share
    (``backoffLimit`` = max_retries, the spec's timeout as ``activeDeadlineSeconds``)."""
    run: dict[str, Any] = {"backoffLimit": spec.max_retries, "cleanPodPolicy": clean_pods}
    if spec.timeout:
        run["activeDeadlineSeconds"] = int(spec.timeout)
    return [entry_config_map(name, opts, spec), {"apiVersion": api_version, "kind": kind,
                                                 "metadata": _meta(name, opts, spec), "spec": {**body, "runPolicy": run}}]


def tf_job(spec: JobSpec, opts: AksOptions, name: str | None = None) -> list[dict]:
    """[ConfigMap, TFJob]: a pod per worker (``Worker``, ``worker_count``) and per parameter server (``PS``),
    each running the command once under the pod entry, with the TF_CONFIG the operator sets (every task at
    ``<job>-<type>-<i>.<namespace>.svc:2222``, as the local launcher gives each its own address). Workers
    share a node's GPUs as the local launcher shares its nodes (worker ``i`` on node ``i % instance_count``);
    parameter servers get none. Kubeflow's ExitCode policy as for the PyTorchJob: a worker whose script
    checkpointed after SIGTERM exits 143 (recreated), a 78 fails the job, and so does any other failure (the
    operator counts ``backoffLimit``, the spec's max_retries, only for pods restarted in place); the job
    succeeds when every worker has (``successPolicy: AllWorkers``, the local rule) and the parameter servers,
    which never end by themselves, are then deleted (``cleanPodPolicy: Running``)."""
    sku = check_job(spec, opts)
    d = spec.distribution
    workers, ps = getattr(d, "worker_count", 1), getattr(d, "parameter_server_count", 0)
    name = name or k8s_name(spec.name)
    per_node = -(-workers // spec.nodes)
    if sku.gpus and per_node > sku.gpus:
        raise DeployError(f"{workers} workers on {spec.nodes} node(s) put {per_node} on a node of {sku.name}, which "
                          f"has {sku.gpus} GPU(s): a worker needs one", where="distribution.worker_count",
                          fix=f"use at most {sku.gpus * spec.nodes} workers, or more nodes (instance_count)")
    worker_gpus = sku.gpus // per_node if sku.gpus else 0
    port = [{"name": "tfjob-port", "containerPort": TF_PORT}]

    def template(gpus: int) -> dict:
        return pod_template(spec, opts, sku, command=[], labels={"azulite.io/job": name}, restart_policy="Never",
                            env_extra={}, entry_map=f"{name}-entry", exit_preempted=EXIT_RETRYABLE,
                            container_name=TF_CONTAINER, gpus=gpus, indexed=False, ports=port)

    replicas: dict[str, Any] = {}
    if ps:
        replicas["PS"] = {"replicas": ps, "restartPolicy": "ExitCode", "template": template(0)}
    replicas["Worker"] = {"replicas": workers, "restartPolicy": "ExitCode", "template": template(worker_gpus)}
    return kubeflow_job("TFJob", name, opts, spec, {"tfReplicaSpecs": replicas, "successPolicy": "AllWorkers"},
                         clean_pods="Running")
