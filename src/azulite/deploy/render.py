"""``deploy render`` / ``cluster render``: a spec file in, named documents out, written all or nothing."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Literal

import yaml

from azulite.deploy import azureml, azureml_serving, cluster, objects, serving, training
from azulite.deploy.image import dockerfile
from azulite.deploy.options import AksOptions
from azulite.errors import AzuliteError, DeployError
from azulite.spec.serving import ServingSpec, load_model, read_yaml, spec_kind

Target = Literal["aks", "azureml"]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (a script in a ConfigMap) as literal blocks, readable and diffable as the file; an
    object used twice (two pod templates' labels) written out twice, not as a YAML anchor and alias."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    block = "\n" in value and not any(line != line.rstrip() for line in value.splitlines())
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if block else None)


_Dumper.add_representer(str, _str)


def dump_all(docs: Iterable[dict]) -> str:
    return yaml.dump_all(list(docs), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def render_spec(path: str | Path, target: Target, aks: AksOptions, aml: azureml.AzureMLOptions,
                overrides: Iterable[str] = (), out: str | Path | None = None) -> dict[str, str]:
    """File name -> content for a job or serving spec. Every check runs before anything is returned.
    ``out``: the folder the files go to (an Azure ML job's ``code`` is written relative to it, as ``az ml job
    create -f`` reads it, not as this machine's absolute path)."""
    from azulite.spec.loader import load_job

    data, _ = read_yaml(path)
    kind = spec_kind(data)
    if kind == "cluster":
        raise DeployError("this is a cluster spec", where=str(path), fix=f"use `azulite cluster render {path} --resource-group RG`")
    if kind == "serving":
        return _render_serving(path, target, aks, aml, overrides, out)
    if aks.storage_key_secret:
        raise DeployError("--storage-key-secret is for serving specs (the key Triton or azulite serve reads a "
                          "repository with); a job reaches Blob through workload identity", where="--storage-key-secret",
                          fix="drop --storage-key-secret")
    if isinstance(data, dict) and data.get("type") == "sweep":
        return _render_sweep(path, target, aml, overrides, out)
    job = load_job(path, overrides)
    if target == "azureml":
        doc = azureml.command_job(job, aml)
        if out is not None:
            doc["code"] = os.path.relpath(job.code, Path(out).resolve())
        return {f"{training.k8s_name(job.name)}.azureml.yml": dump_all([doc])}
    made = objects.training_objects(job, aks)
    name = training.k8s_name(job.name)
    files = {f"{name}-{objects.FLAVOR_OF_KIND[made[-1]['kind']]}.yaml": dump_all(made)}
    docker = dockerfile(job, aks)
    if docker:
        files["Dockerfile"] = docker
    return files


#: AKS options a serving spec has no use for (its image is --image or its own; it runs no code snapshot,
#: writes no outputs and takes no training flavor): flag -> (value when not given, read from AksOptions)
_JOB_ONLY = {"--flavor": ("flavor", "indexed-job"), "--code-uri": ("code_uri", None), "--pvc": ("pvc", None),
             "--termination-grace": ("termination_grace_s", 120)}


def _field_path(field: str) -> tuple:
    """``resources.cpu`` -> ("resources", "cpu"); ``pools[2].sku`` -> ("pools", 2, "sku")."""
    out: list = []
    for part in field.split("."):
        name, *idx = part.replace("]", "").split("[")
        out += [name, *(int(i) for i in idx)]
    return tuple(out)


def _placed(e: AzuliteError, path: str | Path, overrides: Iterable[str], fields_of: Iterable[str] = ()) -> AzuliteError:
    """An error about a spec field, said at its line (``file:line (field)``) or at the --set that gave it."""
    from azulite.spec.loader import parse_overrides
    from azulite.spec.serving import _line_of

    fields = (e.where or "").split(", ")
    if not fields[0] or fields[0].split(".")[0].split("[")[0] not in (fields_of or ServingSpec.model_fields):
        return e
    first = _field_path(fields[0])
    for p, _, item in parse_overrides(overrides):
        if first[: len(p)] == p or p[: len(first)] == first:
            e.where = f"--set {item} ({e.where})"
            return e
    _, node = read_yaml(path)
    line = _line_of(node, first)
    e.where = f"{path}:{line} ({e.where})" if line else f"{path} ({e.where})"
    return e


def _render_serving(path: str | Path, target: Target, aks: AksOptions, aml: azureml.AzureMLOptions,
                    overrides: Iterable[str], out: str | Path | None) -> dict[str, str]:
    """A serving spec: Deployment + Service (+ HPA) for AKS; endpoint + deployment (+ autoscale commands) for
    Azure ML. A local repository is resolved against the spec file, and written relative to ``out``."""
    spec = load_model(path, ServingSpec, overrides)
    unused = [flag for flag, (attr, default) in _JOB_ONLY.items() if getattr(aks, attr) != default]
    if unused:
        raise DeployError(f"{', '.join(unused)} {'applies' if len(unused) == 1 else 'apply'} to job specs; this is a "
                          "serving spec", where=unused[0], fix=f"drop {' '.join(unused)}")
    try:
        if target == "aks":
            return {f"{spec.name}.yaml": dump_all(serving.serving_objects(spec, aks))}
        repo, local = spec.model_repository, None
        if "://" not in repo and not repo.startswith("azureml:"):  # a local folder, relative to the spec file
            local = azureml_serving.local_repository((Path(path).resolve().parent / repo).resolve(),
                                                     Path(out) if out is not None else None)
        files = {f"{spec.name}-endpoint.yml": dump_all([azureml_serving.online_endpoint(spec)]),
                 f"{spec.name}-deployment.yml": dump_all([azureml_serving.online_deployment(spec, aml, local_path=local)])}
        if spec.autoscaling:
            files[f"{spec.name}-autoscale.sh"] = azureml_serving.autoscale_script(spec)
        return files
    except AzuliteError as e:
        raise _placed(e, path, overrides) from None


def _render_sweep(path: str | Path, target: Target, aml: azureml.AzureMLOptions, overrides: Iterable[str],
                  out: str | Path | None) -> dict[str, str]:
    """A sweep job as Azure ML's sweep job; AKS has no sweep of its own to render it as."""
    from azulite.spec.sweep import load_sweep

    sweep = load_sweep(path, overrides)  # every check of the sweep and its trial first
    if target == "aks":
        raise DeployError("--target aks renders command jobs and serving specs; this is a sweep job (type: sweep), "
                          "which Kubernetes has no object for", where=str(path),
                          fix=f"render it for Azure ML (azulite deploy render {path} --target azureml: a sweep job "
                              f"there), or run it here (azulite job submit {path})")
    doc = azureml.sweep_job(sweep, aml)
    if out is not None:
        doc["trial"]["code"] = os.path.relpath(doc["trial"]["code"], Path(out).resolve())
    return {f"{training.k8s_name(sweep.name)}.azureml.yml": dump_all([doc])}


def render_cluster(path: str | Path, aks: cluster.AksCluster) -> dict[str, str]:
    """The files of ``cluster render`` for a cluster spec (``azulite.spec.cluster``, as ``simulate`` reads)."""
    from azulite.spec.cluster import ClusterSpec, load_cluster

    spec = load_cluster(path)
    try:
        files = {"nodepools.sh": cluster.nodepool_script(spec, aks)}
        if cluster.gpu_pools(spec):  # a cluster without GPU pools has no node for these to run on
            files.update({
                "nvidia-device-plugin.yaml": dump_all(cluster.device_plugin(aks, spec)),
                "dcgm-exporter.yaml": dump_all(cluster.dcgm_exporter(aks, spec)),
                "gpu-alerts.yaml": dump_all([cluster.prometheus_rule(aks)]),
                # the same groups as a plain rules file: `promtool check rules`, or Prometheus without the operator
                "gpu-alerts.rules.yml": cluster.rule_file(aks),
            })
        return files
    except AzuliteError as e:
        raise _placed(e, path, (), ClusterSpec.model_fields) from None


def write_files(out: str | Path, files: dict[str, str]) -> list[Path]:
    """Write every file or none: into a temporary folder beside ``out``, then moved in one by one with
    ``os.replace`` (an interrupted render leaves earlier versions whole, never half a file)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DeployError("--out is a file, not a folder", where=str(out),
                          fix=f"name a folder to write the manifests into, e.g. --out {out.parent / 'build'}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way further up, or no permission
        raise DeployError(f"cannot create the --out folder ({exc.strerror})", where=str(out),
                          fix="name a folder you can write to") from None
    tmp = Path(tempfile.mkdtemp(prefix=".render-", dir=out))
    try:
        for name, content in files.items():
            (tmp / name).write_text(content)
            if name.endswith(".sh"):
                (tmp / name).chmod(0o755)
        written = []
        for name in files:
            os.replace(tmp / name, out / name)
            written.append(out / name)
        return written
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
