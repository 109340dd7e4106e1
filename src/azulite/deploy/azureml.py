"""A job spec as an Azure ML command job or sweep job (seed 001 §1.2), as the YAML ``az ml`` and azure-ai-ml's
``load_*`` read (a serving spec as a managed online endpoint: ``azulite.deploy.azureml_serving``).

Written as plain YAML documents rather than built with azure-ai-ml entities: rendering must not need the
SDK (a 1.5 s import and a large dependency tree) and 1.x has dump traps (``command()`` returns a pipeline
node, ``ManagedOnlineEndpoint.dump`` writes nothing: FIELD-NOTES). Tests load every document back with
azure-ai-ml; ``azulite.launch.azureml`` submits the same document.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from azulite.deploy.image import DEFAULT_BASE
from azulite.deploy.sku import check_processes, sku_facts
from azulite.errors import AzuliteError, DeployError
from azulite.spec.job import JobSpec, MpiDistribution, PathInput, PyTorchDistribution, TensorFlowDistribution

if TYPE_CHECKING:
    from azulite.spec.sweep import SweepSpec

SCHEMA = "https://azuremlschemas.azureedge.net/latest/{}.schema.json"


@dataclass(frozen=True)
class AzureMLOptions:
    #: the compute cluster (``azureml:<name>``); default: the spec's ``compute``
    compute: str | None = None
    #: the datastore whose container az:// locations live in (outputs and model paths)
    datastore: str | None = None
    #: the storage account of az:// inputs (read over https)
    storage_account: str | None = None
    experiment_name: str | None = None


def _az_to_datastore(uri: str, opts: AzureMLOptions, field: str) -> str:
    if not opts.datastore:
        raise DeployError(f"{uri} needs the Azure ML datastore registered for its container", where=field,
                          fix="pass --datastore NAME (az ml datastore list), or use an azureml:// path")
    _, _, path = uri[len("az://"):].partition("/")
    return f"azureml://datastores/{opts.datastore}/paths/{path}"


def _environment(spec: JobSpec) -> Any:
    env = spec.environment
    if env is None:
        raise DeployError("an Azure ML job needs an environment", where="environment",
                          fix="set environment: azureml:AzureML-acpt-pytorch-2.2-cuda12.1@latest, or {image: ..., conda_file: ...}")
    if isinstance(env, str):
        return env if env.startswith("azureml:") or "/" not in env else {"image": env}
    out: dict[str, Any] = {"image": env.image or DEFAULT_BASE}
    if env.conda_file:
        out["conda_file"] = env.conda_file
    if env.name:
        out["name"] = env.name
    if env.version:
        out["version"] = env.version
    return out


def _distribution(spec: JobSpec) -> dict | None:
    d = spec.distribution
    if isinstance(d, PyTorchDistribution):
        return {"type": "pytorch", "process_count_per_instance": d.process_count_per_instance}
    if isinstance(d, MpiDistribution):
        return {"type": "mpi", "process_count_per_instance": d.process_count_per_instance}
    if isinstance(d, TensorFlowDistribution):
        return {"type": "tensorflow", "worker_count": d.worker_count, "parameter_server_count": d.parameter_server_count}
    return None


def check_azureml_fields(spec: JobSpec) -> None:
    """azulite's own fields an Azure ML command job has no place for: refused, not dropped, by ``deploy
    render --target azureml`` and ``job submit --backend azureml`` alike (both render through here)."""
    lost = []
    if spec.max_restarts:
        lost.append(("max_restarts", f"max_restarts ({spec.max_restarts}): it restarts no workers in place "
                                     "(torchrun's --max-restarts)", "--set max_restarts=0"))
    if spec.elastic is not None:
        lost.append(("elastic", f"elastic ({spec.elastic.min_nodes} to {spec.nodes} nodes): it starts a fixed "
                                "instance_count, no node range", "--set elastic=null"))
    if lost:
        raise DeployError(
            "an Azure ML command job has no place for " + "; ".join(what for _, what, _ in lost),
            where=", ".join(field for field, _, _ in lost),
            fix=f"remove {' and '.join(f for f, _, _ in lost)} from the spec for Azure ML, or on the command line "
                f"{' '.join(s for _, _, s in lost)}; or run it where they apply: --backend local or kubernetes, "
                "--target aks")


def command_job(spec: JobSpec, opts: AzureMLOptions) -> dict:
    """The command job document (``az ml job create -f``; ``load_job``)."""
    sku = sku_facts(spec.resources.instance_type)
    if spec.distribution_type in ("pytorch", "mpi"):
        check_processes(spec.processes_per_node, sku)
    check_azureml_fields(spec)
    compute = opts.compute or spec.azureml.get("compute")
    if not compute:
        raise DeployError("no compute cluster to run on", where="compute",
                          fix="add `compute: azureml:gpu-cluster` to the spec or pass --compute gpu-cluster")
    if not str(compute).startswith("azureml:"):
        compute = f"azureml:{compute}"
    inputs: dict[str, Any] = {}
    for name, v in spec.inputs.items():
        if not isinstance(v, PathInput):
            inputs[name] = v
            continue
        path = v.path
        if path.startswith("az://"):
            if not opts.storage_account:
                raise DeployError(f"input {name!r} ({path}) needs its storage account", where=f"inputs.{name}.path",
                                  fix="pass --storage-account ACCOUNT, or use an azureml:// path")
            container, _, rest = path[len("az://"):].partition("/")
            path = f"https://{opts.storage_account}.blob.core.windows.net/{container}/{rest}"
        elif path.startswith("nfs://"):
            raise DeployError(f"input {name!r} is an NFS export; Azure ML jobs read datastores", where=f"inputs.{name}.path",
                              fix="register the data as a datastore/data asset and use its azureml:// path")
        item = {"type": v.type, "path": path}
        if v.mode:
            item["mode"] = v.mode
        inputs[name] = item
    outputs: dict[str, Any] = {}
    for name, o in spec.outputs.items():
        item: dict[str, Any] = {"type": o.type}
        if o.path and o.path.startswith("az://"):
            item["path"] = _az_to_datastore(o.path, opts, f"outputs.{name}.path")
        elif o.path and o.path.startswith("azureml://"):
            item["path"] = o.path
        # a local path means "the default datastore" in the cloud: Azure ML picks the location
        if o.mode:
            item["mode"] = o.mode
        outputs[name] = item
    doc: dict[str, Any] = {
        "$schema": SCHEMA.format("commandJob"), "type": "command",
        "display_name": spec.azureml.get("display_name", spec.name),
        "experiment_name": opts.experiment_name or spec.azureml.get("experiment_name", spec.name),
        "code": spec.code, "command": spec.command,
        "environment": _environment(spec), "compute": compute,
        "resources": {"instance_type": sku.name, "instance_count": spec.nodes, **{
            key: value for key in ("shm_size", "properties", "docker_args", "locations", "max_instance_count")
            if (value := getattr(spec.resources, key)) is not None}},  # shm_size and properties were dropped
    }
    for key, value in (("inputs", inputs), ("outputs", outputs), ("environment_variables", spec.environment_variables)):
        if value:
            doc[key] = dict(value)
    dist = _distribution(spec)
    if dist:
        doc["distribution"] = dist
    # Azure ML's own keys the spec carries go through as written (the service sets status, id, ...)
    for key in ("description", "tags", "properties", "identity", "services", "is_deterministic"):
        if spec.azureml.get(key) is not None:
            doc[key] = spec.azureml[key]
    limits = dict(spec.azureml.get("limits") or {})
    if spec.timeout:
        limits["timeout"] = int(spec.timeout)
    if limits:
        doc["limits"] = limits
    queue = dict(spec.azureml.get("queue_settings") or {})
    if spec.priority == "spot":
        queue["job_tier"] = "spot"  # low-priority (evictable) capacity
    if queue:
        doc["queue_settings"] = queue
    return doc


#: what a sweep's ``trial:`` holds of its command job (azure-ai-ml's ParameterizedCommandSchema); the rest of
#: the rendered command job (inputs, outputs, compute, queue_settings, limits) is the sweep's own
_TRIAL_KEYS = ("code", "command", "environment", "environment_variables", "distribution", "resources")


def sweep_job(sweep: SweepSpec, opts: AzureMLOptions) -> dict:
    """The sweep job document (``type: sweep``; ``az ml job create -f``, azure-ai-ml's ``load_job``): the trial
    rendered, and checked, as :func:`command_job` renders a command job, its command fields under ``trial:``
    (``${{search_space.NAME}}`` kept for Azure ML to fill), the sweep's sampling, search space, objective,
    limits and early termination beside it, as azulite read them."""
    trial = sweep.trial_spec()
    opts = dataclasses.replace(opts, compute=opts.compute or sweep.azureml.get("compute"),
                               experiment_name=opts.experiment_name or sweep.azureml.get("experiment_name", sweep.name))
    try:
        cmd = command_job(trial, opts)
    except AzuliteError as e:  # the trial's fields, as the sweep's file places them
        fields = (e.where or "").split(", ")
        if fields[0].split(".")[0] in JobSpec.model_fields and fields[0].split(".")[0] not in ("inputs", "outputs"):
            e.where = ", ".join(f"trial.{w}" for w in fields)
            for w in fields:  # `set resources.instance_type`, `--set max_restarts=0`: the trial's
                e.fix = re.sub(rf"(?<![\w.]){re.escape(w)}\b", f"trial.{w}", e.fix or "") or None
        raise
    limits: dict[str, Any] = sweep.limits.model_dump(exclude_none=True)
    if trial.timeout and "trial_timeout" not in limits:  # the trial's own timeout
        limits["trial_timeout"] = trial.timeout
    limits = {k: int(v) if k.endswith("timeout") else v for k, v in limits.items()}
    doc: dict[str, Any] = {
        "$schema": SCHEMA.format("sweepJob"), "type": "sweep",
        "display_name": sweep.azureml.get("display_name", sweep.name), "experiment_name": cmd["experiment_name"],
        "compute": cmd["compute"],
        "trial": {k: cmd[k] for k in _TRIAL_KEYS if k in cmd},
        **{k: cmd[k] for k in ("inputs", "outputs", "queue_settings") if k in cmd},
        "sampling_algorithm": sweep.sampling_algorithm.model_dump(exclude_none=True),
        "search_space": {name: d.model_dump() for name, d in sweep.search_space.items()},
        "objective": sweep.objective.model_dump(),
        "limits": limits,
    }
    if sweep.early_termination is not None:
        doc["early_termination"] = sweep.early_termination.model_dump(exclude_none=True)
    for key in ("description", "tags", "properties", "identity", "services"):
        if sweep.azureml.get(key) is not None:
            doc[key] = sweep.azureml[key]
    return doc
