"""Offline schema checks for rendered objects, reporting every error (not the first).

- Built-in kinds: the strict JSON schemas kubernetes-validate ships (generated from Kubernetes' published
  OpenAPI, one set per minor version); strict = unknown fields are errors. kubernetes_validate.validate()
  stops at the first error, so the same schemas are walked here with jsonschema's iter_errors.
- PyTorchJob, TFJob, MPIJob: the openAPIV3Schema of the Kubeflow training-operator and mpi-operator CRDs
  (data/, see data/README.md),
  made strict the way ``kubectl apply --validate=strict`` treats a structural schema: an object with
  ``properties`` and no ``additionalProperties``/``x-kubernetes-preserve-unknown-fields`` admits no other key;
  then what the operator's validating webhooks refuse (``pytorchjob_admission_errors``,
  ``tfjob_admission_errors``), or for an MPIJob what the mpi-operator's controller refuses
  (``mpijob_validation_errors``).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

import kubernetes_validate.utils as kv

DATA = Path(__file__).parent / "data"
VERSIONS = ("1.30", "1.37")


@functools.lru_cache(maxsize=None)
def _definitions(version: str) -> Resource:
    return Resource.from_contents(kv.schema_contents(f"kubernetes-json-schema/v{version}.0-local-strict/_definitions.json", version))


def _validator(version: str, kind: str, api_version: str) -> jsonschema.Validator:
    group = api_version.split("/")[0].split(".")[0] + "-" + api_version.split("/")[-1] if "/" in api_version else api_version
    return _file_validator(version, f"{kind.lower()}-{group}.json")


@functools.lru_cache(maxsize=None)
def _file_validator(version: str, filename: str) -> jsonschema.Validator:
    schema = kv.schema_contents(f"kubernetes-json-schema/v{version}.0-local-strict/{filename}", version)
    registry = Resource.from_contents(schema) @ Registry()
    registry = _definitions(version) @ registry
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def _fmt(e: jsonschema.ValidationError) -> str:
    return f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"


def k8s_errors(obj: dict, version: str) -> list[str]:
    """Every strict-schema error of a built-in object for Kubernetes ``version`` (e.g. "1.30")."""
    v = _validator(version, obj["kind"], obj["apiVersion"])
    return sorted(_fmt(e) for e in v.iter_errors(obj))


def file_errors(obj: Any, filename: str, version: str = "1.37") -> list[str]:
    """Errors of ``obj`` against one schema file by name (e.g. ``deleteoptions-meta-v1.json``)."""
    return sorted(_fmt(e) for e in _file_validator(version, filename).iter_errors(obj))


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        node = {k: _strict(v) for k, v in node.items()}
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@functools.lru_cache(maxsize=None)
def _crd_validator(filename: str) -> jsonschema.Validator:
    crd = yaml.safe_load((DATA / filename).read_text())
    version = next(v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage"))
    schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    # metadata is the API server's ObjectMeta, not part of a CRD's schema
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.validators.Draft202012Validator(schema)


#: kind -> (apiVersion, the CRD file in data/)
CRDS = {
    "PyTorchJob": ("kubeflow.org/v1", "kubeflow.org_pytorchjobs-v1.9.0.yaml"),
    "TFJob": ("kubeflow.org/v1", "kubeflow.org_tfjobs-v1.9.0.yaml"),
    "MPIJob": ("kubeflow.org/v2beta1", "kubeflow.org_mpijobs-v0.8.2.yaml"),
    "PrometheusRule": ("monitoring.coreos.com/v1", "monitoring.coreos.com_prometheusrules-v0.82.2.yaml"),
}


def crd_errors(obj: dict) -> list[str]:
    api_version, filename = CRDS[obj["kind"]]
    errors = []
    if obj.get("apiVersion") != api_version:
        errors.append(f"<root>: apiVersion {obj.get('apiVersion')!r} is not {api_version}")
    errors += sorted(_fmt(e) for e in _crd_validator(filename).iter_errors(obj))
    return errors


def pytorchjob_errors(obj: dict) -> list[str]:
    return crd_errors({**obj, "kind": "PyTorchJob"}) if obj.get("kind") == "PyTorchJob" else [f"<root>: not a PyTorchJob ({obj.get('kind')})"]


_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def pytorchjob_admission_errors(obj: dict) -> list[str]:
    """What the training operator's validating webhook refuses in a PyTorchJob that its CRD schema lets
    through (kubeflow/training-operator pkg/webhooks/pytorch/pytorchjob_webhook.go, read at 06f6008e; its
    failurePolicy is Fail, so a refusal is the API server's): the name a DNS-1035 label, only Master and
    Worker replicas, each with containers that all have an image and one named ``pytorch``, Master replicas
    1 and any other at least 1, a Worker when there is an elasticPolicy, and not both ``nProcPerNode``
    forms."""
    errs = []
    name = obj.get("metadata", {}).get("name", "")
    if len(name) > 63 or not _DNS1035.fullmatch(name):
        errs.append(f"metadata.name: {name!r} is not a DNS-1035 label (a letter first)")
    spec = obj.get("spec") or {}
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if "elasticPolicy" in spec:
        if "Worker" not in replicas:
            errs.append("spec.pytorchReplicaSpecs[Worker]: must be configured if elastic policy is used")
        if "nProcPerNode" in spec["elasticPolicy"] and "nprocPerNode" in spec:
            errs.append("spec.elasticPolicy.nProcPerNode: must not be used with spec.nprocPerNode")
    for rtype, rspec in replicas.items():
        where = f"spec.pytorchReplicaSpecs[{rtype}]"
        if rtype not in ("Master", "Worker"):
            errs.append(f"{where}: not a replica type (Master, Worker)")
        containers = ((rspec or {}).get("template") or {}).get("spec", {}).get("containers") or []
        if not containers:
            errs.append(f"{where}.template.spec.containers: must be specified")
        errs += [f"{where}.template.spec.containers[{i}].image: must be required"
                 for i, c in enumerate(containers) if not c.get("image")]
        if not any(c.get("name") == "pytorch" for c in containers):
            errs.append(f"{where}.template.spec.containers: must have at least one container with name pytorch")
        n = (rspec or {}).get("replicas")
        if rtype == "Master" and n != 1:
            errs.append(f"{where}.replicas: must be 1")
        elif isinstance(n, int) and n < 1:  # another type: the CRD schema's error
            errs.append(f"{where}.replicas: must be at least 1")
    return errs


def tfjob_admission_errors(obj: dict) -> list[str]:
    """What the training operator's validating webhook refuses in a TFJob that its CRD schema lets through
    (kubeflow/training-operator pkg/webhooks/tensorflow/tfjob_webhook.go at v1.9.0, 6f74c7f6; failurePolicy
    Fail): the name a DNS-1035 label, ``tfReplicaSpecs`` present, each replica type with containers that all
    have an image and one named ``tensorflow``, at most one Chief or Master."""
    errs = []
    name = obj.get("metadata", {}).get("name", "")
    if len(name) > 63 or not _DNS1035.fullmatch(name):
        errs.append(f"metadata.name: {name!r} is not a DNS-1035 label (a letter first)")
    replicas = (obj.get("spec") or {}).get("tfReplicaSpecs")
    if replicas is None:
        errs.append("spec.tfReplicaSpecs: must be required")
    for rtype, rspec in (replicas or {}).items():
        where = f"spec.tfReplicaSpecs[{rtype}].template.spec.containers"
        containers = ((rspec or {}).get("template") or {}).get("spec", {}).get("containers") or []
        if not containers:
            errs.append(f"{where}: must be specified")
        errs += [f"{where}[{i}].image: must be required" for i, c in enumerate(containers) if not c.get("image")]
        if not any(c.get("name") == "tensorflow" for c in containers):
            errs.append(f"{where}: must have at least one container with name tensorflow")
    if sum(1 for rtype in replicas or {} if rtype in ("Chief", "Master")) > 1:
        errs.append("spec.tfReplicaSpecs: must not have more than 1 Chief or Master role")
    return errs


def mpijob_validation_errors(obj: dict) -> list[str]:
    """What kubeflow/mpi-operator refuses in an MPIJob that its CRD schema lets through
    (pkg/apis/kubeflow/validation/validation.go at caa3c47, "Prepare v0.8.2"). The operator checks it in its
    controller, not a webhook: the API server stores such a job and the operator never starts it (a warning
    event is all). ``<job>-worker-<last>`` a DNS-1035 label; ``slotsPerWorker`` >= 0 and set;
    ``runPolicy.cleanPodPolicy`` set (None, Running, All), its counts >= 0; ``sshAuthMountPath`` set;
    ``mpiImplementation`` OpenMPI, Intel or MPICH; a Launcher replica spec with ``replicas`` 1; each replica
    spec with ``replicas`` (a Worker's >= 1), ``restartPolicy`` Never or OnFailure, and a container."""
    errs = []
    spec = obj.get("spec") or {}
    replicas = spec.get("mpiReplicaSpecs") or {}
    n = (replicas.get("Worker") or {}).get("replicas") or 1
    host = f"{obj.get('metadata', {}).get('name', '')}-worker-{max(n, 1) - 1}"
    if len(host) > 63 or not _DNS1035.fullmatch(host):
        errs.append(f"metadata.name: the pod hostname {host!r} would not be a DNS-1035 label")
    if spec.get("slotsPerWorker") is None:
        errs.append("spec.slotsPerWorker: must have number of slots per worker")
    elif spec["slotsPerWorker"] < 0:
        errs.append("spec.slotsPerWorker: must be >= 0")
    run = spec.get("runPolicy") or {}
    if run.get("cleanPodPolicy") not in ("None", "Running", "All"):
        errs.append(f"spec.runPolicy.cleanPodPolicy: {run.get('cleanPodPolicy')!r} is not None, Running or All")
    errs += [f"spec.runPolicy.{k}: must be >= 0" for k in ("ttlSecondsAfterFinished", "activeDeadlineSeconds",
                                                            "backoffLimit") if run.get(k, 0) < 0]
    if not spec.get("sshAuthMountPath"):
        errs.append("spec.sshAuthMountPath: must have a mount path for SSH credentials")
    if spec.get("mpiImplementation") not in ("OpenMPI", "Intel", "MPICH"):
        errs.append(f"spec.mpiImplementation: {spec.get('mpiImplementation')!r} is not OpenMPI, Intel or MPICH")
    if "Launcher" not in replicas:
        errs.append("spec.mpiReplicaSpecs[Launcher]: must have Launcher replica spec")
    for rtype, rspec in replicas.items():
        where, rspec = f"spec.mpiReplicaSpecs[{rtype}]", rspec or {}
        if rspec.get("replicas") is None:
            errs.append(f"{where}.replicas: must define number of replicas")
        elif rtype == "Launcher" and rspec["replicas"] != 1:
            errs.append(f"{where}.replicas: must be 1")
        elif rtype == "Worker" and rspec["replicas"] < 1:
            errs.append(f"{where}.replicas: must be greater than or equal to 1")
        if rspec.get("restartPolicy") not in ("Never", "OnFailure"):
            errs.append(f"{where}.restartPolicy: {rspec.get('restartPolicy')!r} is not Never or OnFailure")
        if not ((rspec.get("template") or {}).get("spec") or {}).get("containers"):
            errs.append(f"{where}.template.spec.containers: must define at least one container")
    return errs


def errors(obj: dict, version: str) -> list[str]:
    """Errors of any rendered object: built-in kinds against Kubernetes, custom resources against their CRD
    (and a PyTorchJob or TFJob against the training operator's admission as well)."""
    if obj.get("kind") == "PyTorchJob":
        return crd_errors(obj) + pytorchjob_admission_errors(obj)
    if obj.get("kind") == "TFJob":
        return crd_errors(obj) + tfjob_admission_errors(obj)
    if obj.get("kind") == "MPIJob":
        return crd_errors(obj) + mpijob_validation_errors(obj)
    if obj.get("kind") in CRDS:
        return crd_errors(obj)
    return k8s_errors(obj, version)


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1)[:4000]
