"""``azulite deploy render`` and ``azulite cluster render``: specs as AKS / Azure ML artifacts on disk."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional

import typer

from azulite.cli import console
from azulite.deploy.options import FLAVORS, check_namespace, check_object_name, check_storage_account
from azulite.errors import AzuliteError

app = typer.Typer(no_args_is_help=True, help=(
    "Render a job or serving spec for AKS or Azure ML.\n\n"
    "Examples:\n\n"
    "  azulite deploy render examples/aks/torchrec/job.yaml --target aks --out build/\n\n"
    "  azulite deploy render examples/aks/torchrec/job.yaml --target aks --flavor pytorchjob --out build/\n\n"
    "  azulite deploy render examples/aks/gpu-workload.yaml --target aks --out build/\n\n"
    "  azulite deploy render examples/aks/triton-endpoint.yaml --target azureml --out build/"))
cluster_app = typer.Typer(no_args_is_help=True, help=(
    "Render what sets up an AKS cluster for GPU work, from the cluster spec `azulite simulate` reads.\n\n"
    "Example:\n\n  azulite cluster render examples/aks/cluster.yaml --resource-group torchrec-rg --out build/cluster"))


# the characters an image reference can hold (the full grammar is the registry's to enforce): a space or a
# '!' would otherwise land in the pod spec and the Dockerfile's tag and fail only at the cluster
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*")


# an Azure resource group: 1-90 letters, digits, '_', '-', '.', '(' and ')', not ending in '.'
_RESOURCE_GROUP = re.compile(r"[-\w.()]{1,90}")


def check_resource_group(value: str) -> None:
    if not _RESOURCE_GROUP.fullmatch(value) or value.endswith("."):
        raise AzuliteError(f"{value!r} is not an Azure resource group name", where="--resource-group",
                           fix="use 1-90 letters, digits, '_', '-', '.', '(' and ')', not ending in '.'; "
                               "`az group list --query [].name` lists yours")


def parse_labels(items: List[str], flag: str) -> dict[str, str]:
    """``["k=v", ...]`` as labels, each checked as Kubernetes checks a label."""
    from azulite.spec import labels

    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        problem = "no '=' in it" if not sep else labels.key_problem(key) or labels.value_problem(value)
        if problem:
            raise AzuliteError(f"{item!r}: {problem}", where=flag,
                               fix=f"write {flag} KEY=VALUE ({labels.RULE}), e.g. {flag} release=kube-prometheus-stack")
        out[key] = value
    return out


@app.command("render")
def render(
    spec: Path = typer.Argument(..., help="A job spec or a serving spec (YAML)."),
    target: str = typer.Option("aks", "--target", help="aks or azureml."),
    out: Path = typer.Option(..., "--out", help="Folder to write into (created)."),
    flavor: str = typer.Option("indexed-job", "--flavor", help="AKS jobs: indexed-job or pytorchjob; tfjob for a tensorflow job, mpijob for an mpi job (also their default)."),
    namespace: str = typer.Option("default", "--namespace", "-n", help="Kubernetes namespace of the rendered objects."),
    image: Optional[str] = typer.Option(None, "--image", help="Image to run (default: the spec's environment.image)."),
    code_uri: Optional[str] = typer.Option(None, "--code-uri", help="az://container/prefix the code snapshot is fetched from (default: baked into the image)."),
    storage_account: Optional[str] = typer.Option(None, "--storage-account", help="Storage account of az:// locations."),
    storage_key_secret: Optional[str] = typer.Option(None, "--storage-key-secret", help="Serving on AKS: a Secret holding the storage account key as azurestorageaccountkey (Triton reads Azure Storage with a key only)."),
    pvc: Optional[str] = typer.Option(None, "--pvc", help="PersistentVolumeClaim for outputs that are not az:// URIs."),
    service_account: str = typer.Option("azulite", "--service-account", help="Service account with a workload identity (Blob)."),
    grace: int = typer.Option(120, "--termination-grace", min=0, help="Seconds for the preemption checkpoint after SIGTERM."),
    compute: Optional[str] = typer.Option(None, "--compute", help="Azure ML compute cluster (default: the spec's compute)."),
    datastore: Optional[str] = typer.Option(None, "--datastore", help="Azure ML datastore of az:// outputs."),
    set_: List[str] = typer.Option([], "--set", help="Override a spec field: --set path=value."),
) -> None:
    """Write the manifests of one spec. Nothing is written unless all of it renders."""
    from azulite.deploy.azureml import AzureMLOptions
    from azulite.deploy.options import AksOptions
    from azulite.deploy.render import render_spec, write_files

    if target not in ("aks", "azureml"):
        raise AzuliteError(f"unknown target {target!r}", where="--target", fix="use --target aks or --target azureml")
    if flavor not in FLAVORS:
        raise AzuliteError(f"unknown flavor {flavor!r}", where="--flavor", fix=f"use --flavor {', '.join(FLAVORS)}")
    # a flag the target does not read would be dropped without a word
    given = {"--image": image, "--code-uri": code_uri, "--pvc": pvc, "--compute": compute, "--datastore": datastore,
             "--storage-key-secret": storage_key_secret,
             "--flavor": flavor != "indexed-job", "--namespace": namespace != "default",
             "--service-account": service_account != "azulite", "--termination-grace": grace != 120}
    other = {"aks": ("--compute", "--datastore"),
             "azureml": ("--image", "--code-uri", "--pvc", "--flavor", "--namespace", "--service-account",
                         "--termination-grace", "--storage-key-secret")}[target]
    unused = [f for f in other if given[f]]
    if unused:
        raise AzuliteError(f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply to --target {target}",
                           where=unused[0], fix=f"drop {' '.join(unused)}, or render for the other target")
    check_namespace(namespace, "--namespace")
    if pvc is not None:
        check_object_name(pvc, "--pvc", "PersistentVolumeClaim", "training-outputs")
    check_object_name(service_account, "--service-account", "ServiceAccount", "azulite")
    if storage_key_secret is not None:
        check_object_name(storage_key_secret, "--storage-key-secret", "Secret", "models-storage")
    if storage_account is not None:
        check_storage_account(storage_account, "--storage-account")
    if image is not None and not _IMAGE.fullmatch(image):
        raise AzuliteError(f"{image!r} is not an image reference", where="--image",
                           fix="write REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST], e.g. myacr.azurecr.io/train:1.0")
    aks = AksOptions(namespace=namespace, flavor=flavor, image=image, code_uri=code_uri, storage_account=storage_account,
                     pvc=pvc, service_account=service_account, termination_grace_s=grace,
                     storage_key_secret=storage_key_secret)
    aml = AzureMLOptions(compute=compute, datastore=datastore, storage_account=storage_account)
    files = render_spec(spec, target, aks, aml, set_, out=out)
    for p in write_files(out, files):
        console.out().print(f"wrote {p}", markup=False)


@cluster_app.command("render")
def cluster_render(
    spec: Path = typer.Argument(..., help="A cluster spec (YAML with `pools:`, as for azulite simulate)."),
    resource_group: str = typer.Option(..., "--resource-group", "-g", help="The AKS cluster's resource group."),
    out: Path = typer.Option(..., "--out", help="Folder to write into (created)."),
    cluster_name: Optional[str] = typer.Option(None, "--cluster-name", help="The AKS cluster (default: the spec's name)."),
    namespace: str = typer.Option("monitoring", "--monitoring-namespace", help="Namespace of the DCGM exporter and alerts."),
    gpu_memory_free_mb: int = typer.Option(1024, "--gpu-memory-free-mb", min=0, help="GPUMemoryExhausted below this many MB free."),
    gpu_temperature_c: int = typer.Option(85, "--gpu-temperature-c", min=1, max=120, help="GPUTemperatureHigh above this many degrees C."),
    alert_for: str = typer.Option("2m", "--alert-for", help="How long free GPU memory stays below --gpu-memory-free-mb before GPUMemoryExhausted fires (GPUTemperatureHigh waits 5m, GPUIdle 30m)."),
    rule_label: List[str] = typer.Option([], "--rule-label", help="KEY=VALUE label of the PrometheusRule, repeatable. kube-prometheus-stack loads only rules labelled release=<its Helm release>: --rule-label release=kube-prometheus-stack."),
) -> None:
    """Write nodepools.sh (az aks nodepool add ...), the NVIDIA device plugin, the DCGM exporter and the GPU alerts."""
    from azulite.deploy.cluster import AksCluster
    from azulite.deploy.render import render_cluster, write_files
    from azulite.observe.rules import is_duration

    check_resource_group(resource_group)
    check_namespace(namespace, "--monitoring-namespace")
    if not is_duration(alert_for):
        raise AzuliteError(f"{alert_for!r} is not a duration", where="--alert-for",
                           fix="write a Prometheus duration: a number and a unit (ms, s, m, h, d, w, y), e.g. --alert-for 2m")
    aks = AksCluster(resource_group=resource_group, cluster_name=cluster_name, monitoring_namespace=namespace,
                     gpu_memory_free_mb=gpu_memory_free_mb, gpu_temperature_c=gpu_temperature_c, alert_for=alert_for,
                     rule_labels=tuple(parse_labels(rule_label, "--rule-label").items()))
    for p in write_files(out, render_cluster(spec, aks)):
        console.out().print(f"wrote {p}", markup=False)
