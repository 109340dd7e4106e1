"""A serving spec as an Azure ML managed online endpoint + a no-code Triton deployment (a ``triton_model``:
no scoring script, no environment; seed 001 §3.3), as the YAML ``az ml online-endpoint|deployment create -f``
and azure-ai-ml's ``load_online_*`` read, checked as azure-ai-ml checks them before it sends anything
(``_to_rest_object``: the endpoint's name, the deployment's scale settings).

Azure runs its own Triton on whole instances of one VM size: what a spec says for AKS (``server: azulite``,
an ``image``, server ``args``, a ``node_pool``, per-replica ``resources``, ``priority: spot``) has no place
there and is refused with the fix, not dropped. A managed deployment takes only default scale settings
(azure-ai-ml: "ManagedOnlineEndpoint supports DefaultScaleSettings only"): ``autoscaling`` is rendered as
Azure Monitor autoscale commands (``<name>-autoscale.sh``), the way Azure ML documents autoscaling an
online endpoint.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

from azulite.deploy.azureml import SCHEMA, AzureMLOptions, _az_to_datastore
from azulite.deploy.sku import sku_facts
from azulite.errors import DeployError
from azulite.spec.serving import ServingSpec

#: azure-ai-ml's rule for an endpoint's (and a deployment's) name (EndpointConfigurations: 3-32 characters,
#: NAME_REGEX_PATTERN), which it checks before creating either
ENDPOINT_NAME = re.compile(r"[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?")
ENDPOINT_NAME_LEN = (3, 32)
DEPLOYMENT = "blue"


def check_endpoint_name(name: str) -> None:
    lo, hi = ENDPOINT_NAME_LEN
    if not (lo <= len(name) <= hi and ENDPOINT_NAME.fullmatch(name)):
        short = name[:hi + 1].rsplit("-", 1)[0] if len(name) > hi else f"{name}-endpoint"  # at a word's end
        raise DeployError(
            f"{name!r} ({len(name)} characters) cannot name an Azure ML online endpoint: its name is {lo} to {hi} "
            "letters, digits and '-', a letter first and a letter or digit last", where="name",
            fix=f"shorten name for --target azureml, e.g. --set name={short}")


def _unfaithful(spec: ServingSpec, gpus_on_vm: int) -> None:
    """What the spec says that a no-code Triton deployment cannot do: all of it named at once."""
    lost: list[tuple[str, str, str]] = []
    if spec.server != "triton":
        lost.append(("server", "server: azulite (Azure runs its own Triton)", "set server: triton"))
    if spec.image:
        lost.append(("image", f"image {spec.image} (Azure runs its own Triton image)", "remove image"))
    if spec.args:
        lost.append(("args", f"server args {' '.join(spec.args)} (Azure starts Triton itself)", "remove args"))
    if spec.priority == "spot":
        lost.append(("priority", "priority: spot (managed endpoints run on dedicated instances)",
                     "remove priority (or --set priority=dedicated)"))
    if spec.node_pool:
        lost.append(("node_pool", f"node_pool {spec.node_pool} (an AKS pool)", "remove node_pool"))
    r = spec.resources
    sized = [f for f in ("cpu", "memory", "cpu_request", "memory_request") if getattr(r, f)]
    if sized:
        lost.append((f"resources.{sized[0]}", f"resources {', '.join(sized)} (each instance is a whole VM)",
                     f"remove resources.{' and resources.'.join(sized)}"))
    if r.gpus is not None and r.gpus != gpus_on_vm:
        lost.append(("resources.gpus", f"resources.gpus {r.gpus} (each instance is a whole VM, with its "
                                       f"{gpus_on_vm} GPU(s))", "remove resources.gpus (or pick instance_type by its GPUs)"))
    if lost:
        raise DeployError(
            "an Azure ML managed online deployment (no-code Triton) has no place for "
            + "; ".join(what for _, what, _ in lost), where=", ".join(f for f, _, _ in lost),
            fix="; ".join(fix for _, _, fix in lost) + " for --target azureml, or render the spec for AKS "
                "(--target aks), where they apply")


def _model(spec: ServingSpec, opts: AzureMLOptions, local_path: str | None) -> Any:
    """The deployment's ``model``: a registered asset by reference, else the repository as a triton_model."""
    repo = spec.model_repository
    asset = re.fullmatch(r"azureml://models/([^/]+)(?:/versions/([^/]+))?", repo)
    if asset:
        return f"azureml:{asset.group(1)}:{asset.group(2) or spec.model_version}"
    if repo.startswith("azureml:") and not repo.startswith("azureml://"):
        return repo  # azureml:NAME:VERSION
    if repo.startswith("az://"):
        path = _az_to_datastore(repo, opts, "model_repository")
    elif repo.startswith("azureml://"):  # a datastore path, a registry's model: Azure ML reads them itself
        if repo.startswith("azureml://registries/"):
            return repo
        path = repo
    elif "://" in repo:
        raise DeployError(f"Azure ML cannot take a {repo.split('://')[0]}:// model path ({repo})", where="model_repository",
                          fix="register the storage as a datastore and use az://CONTAINER/PATH with --datastore NAME, "
                              "or azureml://datastores/NAME/paths/PATH; or a local folder (uploaded at create)")
    else:
        path = local_path or repo
    return {"name": spec.model_name or f"{spec.name}-model", "version": spec.model_version, "path": path,
            "type": "triton_model"}


def online_endpoint(spec: ServingSpec) -> dict:
    check_endpoint_name(spec.name)
    return {"$schema": SCHEMA.format("managedOnlineEndpoint"), "name": spec.name, "auth_mode": spec.auth_mode}


def online_deployment(spec: ServingSpec, opts: AzureMLOptions, *, local_path: str | None = None) -> dict:
    """The deployment document; ``local_path``: a local repository as written into it (relative to the
    folder the documents go to, as ``az ml`` resolves it)."""
    check_endpoint_name(spec.name)
    sku = sku_facts(spec.instance_type, field="instance_type", example="Standard_NC4as_T4_v3",
                    needed_for="an Azure ML online deployment runs on instances of one VM size")
    _unfaithful(spec, sku.gpus)
    doc: dict[str, Any] = {
        "$schema": SCHEMA.format("managedOnlineDeployment"), "name": DEPLOYMENT, "endpoint_name": spec.name,
        "model": _model(spec, opts, local_path), "instance_type": sku.name,
        "instance_count": spec.autoscaling.min_replicas if spec.autoscaling else max(1, spec.replicas),
    }
    if spec.environment_variables:
        doc["environment_variables"] = dict(spec.environment_variables)
    return doc


def autoscale_script(spec: ServingSpec) -> str:
    """Azure Monitor autoscale for the deployment (Azure ML's "Autoscale online endpoints", az CLI):
    ``min_replicas`` to ``max_replicas`` instances, one more above ``target_cpu_utilization`` percent of CPU
    averaged over 5 minutes, one fewer below half of it."""
    a = spec.autoscaling
    assert a is not None
    name = f"autoscale-{spec.name}-{DEPLOYMENT}"
    q = shlex.quote
    rule = ('az monitor autoscale rule create --resource-group "$RG" --autoscale-name {n} '
            '--condition "CpuUtilizationPercentage {op} {v} avg 5m" --scale {way} 1')
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Rendered by `azulite deploy render --target azureml`: autoscaling of deployment {DEPLOYMENT} of endpoint "
        f"{spec.name}.",
        "# A managed online deployment takes no autoscaling in its YAML (only default scale settings): Azure Monitor",
        "# autoscale scales it. Run after `az ml online-deployment create`:",
        f"#   ./{spec.name}-autoscale.sh RESOURCE_GROUP WORKSPACE",
        "set -euo pipefail",
        'RG=${1:?usage: $0 RESOURCE_GROUP WORKSPACE}',
        'WS=${2:?usage: $0 RESOURCE_GROUP WORKSPACE}',
        f'DEPLOYMENT_ID=$(az ml online-deployment show --endpoint-name {q(spec.name)} --name {DEPLOYMENT} '
        '--resource-group "$RG" --workspace-name "$WS" --query id -o tsv)',
        f'az monitor autoscale create --resource-group "$RG" --name {q(name)} --resource "$DEPLOYMENT_ID" '
        f'--min-count {a.min_replicas} --max-count {a.max_replicas} --count {a.min_replicas}',
        rule.format(n=q(name), op=">", v=a.target_cpu_utilization, way="out"),
        rule.format(n=q(name), op="<", v=max(1, a.target_cpu_utilization // 2), way="in"),
    ]) + "\n"


def local_repository(repo: Path, out: Path | None) -> str:
    """A local repository folder as the deployment names it: relative to ``out`` (where ``az ml`` reads the
    document from), else absolute; refused when it is not a folder."""
    if not repo.is_dir():
        what = "is not a folder" if repo.exists() else "does not exist"
        raise DeployError(f"the model repository {repo} {what}", where="model_repository",
                          fix="point model_repository at the repository folder (<model>/config.pbtxt, "
                              "<model>/<version>/...), relative to the spec file")
    return os.path.relpath(repo, out.resolve()) if out is not None else str(repo)
