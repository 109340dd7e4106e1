"""How a spec meets a particular cluster: what the spec cannot say because it is the same everywhere
(namespace, image registry, where the code snapshot lives, which claim holds outputs)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from azulite.errors import DeployError

#: where the code snapshot lives in the pod (the working directory)
CODE_DIR = "/code"
#: a PVC given with --pvc is mounted here; local outputs go to outputs/<name> under it
PVC_DIR = "/mnt/azulite"
#: nfs:// inputs are mounted at /mnt/<input name> (seed 002 mounts its NetApp volume at /mnt/netapp)
NFS_DIR = "/mnt"


# RFC 1123 label, what the API server requires of a namespace; the offline schemas do not check names, so
# a bad one would only be refused at `kubectl apply` (or by the API server at submit)
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def check_namespace(value: str, where: str) -> str:
    """``value`` if it can name a Kubernetes namespace; ``where``: the flag or setting it came from."""
    if not _NAMESPACE.fullmatch(value):
        raise DeployError(f"{value!r} is not a Kubernetes namespace name", where=where,
                          fix="use lowercase letters, digits and '-', starting and ending with a letter or digit, "
                              "at most 63 characters, e.g. ml-training")
    return value


# RFC 1123 subdomain: what the API server requires of a PersistentVolumeClaim's and a ServiceAccount's name
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# an Azure storage account: 3-24 lowercase letters and digits (it is a DNS name under blob.core.windows.net)
_STORAGE_ACCOUNT = re.compile(r"[a-z0-9]{3,24}")


def check_object_name(value: str, where: str, what: str, example: str) -> str:
    """``value`` if it can name a Kubernetes object of the kind ``what`` (a DNS-1123 subdomain, as a
    PersistentVolumeClaim's or a ServiceAccount's name must be); ``where``: the flag or setting."""
    if len(value) > 253 or not _SUBDOMAIN.fullmatch(value):
        raise DeployError(f"{value!r} is not a Kubernetes {what} name", where=where,
                          fix="use lowercase letters, digits, '-' and '.', starting and ending with a letter or "
                              f"digit, at most 253 characters, e.g. {example}")
    return value


def check_storage_account(value: str, where: str) -> str:
    """``value`` if it can name an Azure storage account; ``where``: the flag or setting."""
    if not _STORAGE_ACCOUNT.fullmatch(value):
        raise DeployError(f"{value!r} is not an Azure storage account name", where=where,
                          fix="use 3 to 24 lowercase letters and digits (no '-', '_' or spaces), e.g. mlartifacts01; "
                              "`az storage account list --query [].name` lists yours")
    return value


#: how a job runs on Kubernetes: an Indexed Job (+ headless Service), a Kubeflow PyTorchJob, a Kubeflow
#: TFJob (a tensorflow job's) or MPIJob (an mpi job's), which the default indexed-job renders those jobs as
Flavor = Literal["indexed-job", "pytorchjob", "tfjob", "mpijob"]
FLAVORS: tuple[str, ...] = get_args(Flavor)


@dataclass(frozen=True)
class AksOptions:
    namespace: str = "default"
    flavor: Flavor = "indexed-job"
    #: the image to run; overrides the spec's environment.image (and names the image the Dockerfile builds)
    image: str | None = None
    #: az://container/prefix: the code snapshot is uploaded there at submit and fetched by an init container;
    #: None: the code is baked into the image at /code (the rendered Dockerfile does that)
    code_uri: str | None = None
    #: storage account of az:// locations (code, outputs): adlfs reads AZURE_STORAGE_ACCOUNT_NAME
    storage_account: str | None = None
    #: PersistentVolumeClaim for outputs and checkpoints that are not az:// URIs
    pvc: str | None = None
    #: serving: a Secret holding the storage account's key as ``azurestorageaccountkey`` (Triton reads Azure
    #: Storage with a key only; azulite serve uses it instead of workload identity)
    storage_key_secret: str | None = None
    #: the Kubernetes service account federated with an Azure identity (workload identity) for Blob
    service_account: str = "azulite"
    #: seconds between SIGTERM and SIGKILL: the preemption checkpoint must commit inside it
    termination_grace_s: int = 120
    #: the c10d rendezvous port on pod 0
    rdzv_port: int = 29500
