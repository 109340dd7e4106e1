"""An ``mpi`` job spec as a Kubeflow MPIJob (kubeflow/mpi-operator, ``kubeflow.org/v2beta1``), as Azure ML
runs it: one ``mpirun`` for the whole job, ``process_count_per_instance`` ranks on each of
``instance_count`` nodes.

- ``Worker`` pods (one per node, ``slotsPerWorker`` = processes per node, a GPU per process) run sshd under
  ``pod_mpi.py worker``; the operator mounts its generated SSH key at ``/root/.ssh`` and writes the hostfile
  (``<job>-worker-<i>.<job>.<namespace>.svc slots=N``). A readiness probe on the ssh port holds the launcher
  back until every worker accepts connections (``launcherCreationPolicy: WaitForWorkersReady``; the
  workers' DNS names exist only once they are ready). ``restartPolicy: OnFailure``: a worker stopped
  other than by its deletion restarts in place, under the same name.
- The ``Launcher`` pod (no GPU, kept off spot nodes where it can be) runs ``mpirun`` under
  ``pod_mpi.py launcher``: ``--map-by slot --bind-to none`` (rank ``r`` on node ``r // N``, as locally and
  as torchrun places them), ``--wdir /code``, and ``-x NAME`` for each variable of the job's environment:
  a rank started through ssh sees none of its pod's environment, so NCCL's settings, the output paths, the
  user's ``environment_variables`` and workload identity's variables travel from the launcher. Each rank
  runs under ``pod_mpi.py rank`` (see that file: one SIGTERM per rank on an eviction, a 75 held for the
  peers, mpirun run again in the same pod after a preemption).
- ``runPolicy``: ``backoffLimit`` = max_retries (the operator's launcher Job retries a failed launcher pod;
  a preemption is rerun inside the pod instead and does not count), ``cleanPodPolicy: Running`` (the
  workers' sshd never ends by itself), the spec's timeout as ``activeDeadlineSeconds``.

The image runs sshd and ssh, which Azure ML's images do not hold: an MPI job always builds its image from
the rendered Dockerfile (``azulite.deploy.image``), which adds OpenSSH to the spec's base image.
"""

from __future__ import annotations

from typing import Any

from azulite.deploy.options import CODE_DIR, AksOptions
from azulite.deploy.pod_mpi import ENV_BOARD, ENV_POD_IP
from azulite.deploy.training import (
    ENTRY_DIR, ENTRY_VOLUME, MARKS_VOLUME, SPOT_KEY, PodPlan, check_job, job_env, k8s_name, kubeflow_job, pod_template,
    rank_command,
)
from azulite.spec.job import JobSpec

MPI_CONTAINER = "mpi"  # the operator runs and configures a replica's first container, whatever its name
SSH_PORT = 22
POD_MPI = f"{ENTRY_DIR}/pod_mpi.py"
SSH_DIR = "/root/.ssh"  # the operator's default sshAuthMountPath (the image's user is root)
MPIJOB_API = "kubeflow.org/v2beta1"
#: workload identity's variables (the webhook sets them in both pods; a rank started through ssh needs them
#: from the launcher for az:// outputs)
IDENTITY_ENV = ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_FEDERATED_TOKEN_FILE", "AZURE_AUTHORITY_HOST")
LAUNCHER_REQUESTS = {"cpu": "500m", "memory": "512Mi"}


def _mpirun(spec: JobSpec, plan: PodPlan, env_names: list[str]) -> list[str]:
    forwarded = [*env_names, "PATH", "LD_LIBRARY_PATH", "PYTHONPATH"]
    if plan.uses_blob:
        forwarded += IDENTITY_ENV
    xs = [w for name in dict.fromkeys(forwarded) for w in ("-x", name)]
    return ["mpirun", "--allow-run-as-root", "-np", str(spec.nodes * spec.processes_per_node), "--map-by", "slot",
            "--bind-to", "none", "--tag-output", "--wdir", CODE_DIR, *xs, "-x", ENV_BOARD,
            "python3", POD_MPI, "rank", *rank_command(spec, plan)]


def _launcher_pod(template: dict) -> dict:
    """The launcher's pod: no GPU, any node the workers could use (their tolerations), preferably not a spot
    node (its eviction stops the whole job), with its IP for the ranks to reach its board. It runs no user
    code: none of the job's volumes (a ReadWriteOnce claim could not attach on a second node), no code."""
    pod = template["spec"]
    container = pod["containers"][0]
    keep = (ENTRY_VOLUME, MARKS_VOLUME)
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] in keep]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] in keep]
    container["workingDir"] = "/"
    pod.pop("initContainers", None)
    container["resources"] = {"requests": dict(LAUNCHER_REQUESTS)}
    container["env"].insert(0, {"name": ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    del pod["nodeSelector"]
    pod["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "preference": {"matchExpressions": [{"key": SPOT_KEY, "operator": "NotIn", "values": ["spot"]}]},
    }]}}
    return template


def mpi_job(spec: JobSpec, opts: AksOptions, name: str | None = None) -> list[dict]:
    """[ConfigMap (pod_entry.py, pod_mpi.py), MPIJob]."""
    sku = check_job(spec, opts)
    name = name or k8s_name(spec.name)
    plan = PodPlan(spec, opts)
    labels = {"azulite.io/job": name}
    common: dict[str, Any] = dict(labels=labels, env_extra={}, entry_map=f"{name}-entry", container_name=MPI_CONTAINER,
                                  indexed=False)
    worker = pod_template(spec, opts, sku, command=[], restart_policy="OnFailure",
                          gpus=spec.processes_per_node if sku.gpus else 0,
                          ports=[{"name": "ssh", "containerPort": SSH_PORT}],
                          argv=["python3", POD_MPI, "worker", "--", "/usr/sbin/sshd", "-De"], **common)
    worker["spec"]["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": SSH_PORT}, "periodSeconds": 2}
    # the launcher's environment is the job's, and mpirun passes all of it on
    names = [e["name"] for e in job_env(spec, sku, plan, opts, {})]
    launcher = _launcher_pod(pod_template(
        spec, opts, sku, command=[], restart_policy="Never", gpus=0,
        argv=["python3", POD_MPI, "launcher", "--", *_mpirun(spec, plan, names)], **common))
    for template in (worker, launcher):  # the replica's restartPolicy is the one (the operator warns of another)
        del template["spec"]["restartPolicy"]
    body = {
        "slotsPerWorker": spec.processes_per_node,
        "sshAuthMountPath": SSH_DIR,
        "mpiImplementation": "OpenMPI",
        "launcherCreationPolicy": "WaitForWorkersReady",
        "mpiReplicaSpecs": {
            "Launcher": {"replicas": 1, "restartPolicy": "Never", "template": launcher},
            "Worker": {"replicas": spec.nodes, "restartPolicy": "OnFailure", "template": worker},
        },
    }
    return kubeflow_job("MPIJob", name, opts, spec, body, clean_pods="Running", api_version=MPIJOB_API)
