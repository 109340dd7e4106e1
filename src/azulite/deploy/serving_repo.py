"""Where a serving pod on AKS reads its model repository from, and with which credentials.

- ``server: azulite``: ``az://container/path``, mirrored into an emptyDir cache by ``azulite serve``
  (``azulite.serve.remote``) with ``AZURE_STORAGE_ACCOUNT_NAME`` and, for the credential, an account key from
  ``--storage-key-secret``, a connection string or key the spec sets, or else workload identity
  (``serviceAccountName`` + the ``azure.workload.identity/use`` label, as training pods reach Blob).
- ``server: triton``: what Triton's filesystem layer reads (triton-inference-server/core
  ``src/filesystem``): ``as://ACCOUNT/container/path`` (an ``az://`` URI is rewritten so when the account is
  known), ``s3://``, ``gs://``. Triton 24.01 (the default image) reads Azure Storage with
  ``AZURE_STORAGE_KEY`` (else anonymously): the key comes from ``--storage-key-secret`` (a Secret with
  ``azurestorageaccountkey``, the key name Azure's CSI drivers use) or the spec's ``environment_variables``.
  ``s3://`` and ``gs://`` credentials are the spec's own (``environment_variables``).

A local folder (this machine's disk) or an Azure ML model asset is refused with the fix: no pod reads either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from azulite.deploy.options import AksOptions
from azulite.errors import DeployError
from azulite.spec.serving import ServingSpec

#: where ``azulite serve`` keeps its mirror of an az:// repository (an emptyDir: kept across container restarts)
MODEL_CACHE_DIR = "/var/cache/azulite"
#: the key of the account key in a --storage-key-secret Secret (what Azure's blob and file CSI drivers read)
SECRET_KEY = "azurestorageaccountkey"
_AS_URI = re.compile(r"as://([a-z0-9]{3,24})(?:\.blob\.core\.windows\.net)?/([a-z0-9](?:[a-z0-9-]{1,61}[a-z0-9])?)(/.*)?")
_CONTAINER = re.compile(r"[a-z0-9](?:[a-z0-9-]{1,61}[a-z0-9])?")


@dataclass
class RepoPlan:
    #: the repository as the server is given it
    uri: str
    #: environment entries (name -> EnvVar) the server needs to read it
    env: dict[str, dict] = field(default_factory=dict)
    workload_identity: bool = False
    #: azulite serve's mirror: an emptyDir at MODEL_CACHE_DIR
    cache: bool = False


def _local_or_asset(spec: ServingSpec) -> DeployError | None:
    repo = spec.model_repository
    if repo.startswith("azureml:"):
        return DeployError(
            f"{repo} is an Azure ML model asset: neither Triton nor azulite serve can read it from a pod",
            where="model_repository",
            fix="point model_repository at the Blob folder that holds the repository (az://CONTAINER/PATH; "
                "`az ml model show` names its storage path), or render it for Azure ML: --target azureml")
    if "://" not in repo:
        return DeployError(
            f"{repo} is a folder on this machine: a pod on AKS cannot see it (it is not in the image, and no "
            "volume holds it)", where="model_repository",
            fix="upload it (az storage blob upload-batch -d CONTAINER/PATH -s FOLDER) and set model_repository: "
                "az://CONTAINER/PATH; or render it for Azure ML (--target azureml uploads a local folder)")
    return None


def _key_env(spec: ServingSpec, opts: AksOptions, name: str) -> dict[str, dict] | None:
    """The account key as env ``name`` from --storage-key-secret; None when the spec sets it itself or no
    secret was named."""
    if name in spec.environment_variables or not opts.storage_key_secret:
        return None
    return {name: {"name": name, "valueFrom": {"secretKeyRef": {"name": opts.storage_key_secret, "key": SECRET_KEY}}}}


def _az_parts(repo: str) -> tuple[str, str]:
    container, _, path = repo[len("az://"):].partition("/")
    if not _CONTAINER.fullmatch(container):
        raise DeployError(f"{repo} names no Blob container ({container!r} is not one)", where="model_repository",
                          fix="write az://CONTAINER/PATH (a container: 3-63 lowercase letters, digits and '-')")
    return container, path.strip("/")


def _azulite(spec: ServingSpec, opts: AksOptions) -> RepoPlan:
    repo, env = spec.model_repository, spec.environment_variables
    if not repo.startswith("az://"):
        raise DeployError(f"azulite serve cannot read {repo.split('://')[0]}:// repositories", where="model_repository",
                          fix="upload the repository to Blob and use az://CONTAINER/PATH, or use server: triton (it "
                              "reads as://, s3:// and gs://)")
    _az_parts(repo)
    plan = RepoPlan(uri=repo, cache=True, env={"AZULITE_MODEL_CACHE": {
        "name": "AZULITE_MODEL_CACHE", "value": f"{MODEL_CACHE_DIR}/model-cache"}})
    if "AZURE_STORAGE_CONNECTION_STRING" in env:
        return plan
    account = env.get("AZURE_STORAGE_ACCOUNT_NAME") or opts.storage_account
    if not account:
        raise DeployError(f"{repo} needs its storage account: azulite serve reads Blob at "
                          "https://ACCOUNT.blob.core.windows.net", where="model_repository",
                          fix="pass --storage-account ACCOUNT (or set environment_variables.AZURE_STORAGE_ACCOUNT_NAME)")
    plan.env["AZURE_STORAGE_ACCOUNT_NAME"] = {"name": "AZURE_STORAGE_ACCOUNT_NAME", "value": account}
    if "AZURE_STORAGE_ACCOUNT_KEY" in env:
        return plan
    key = _key_env(spec, opts, "AZURE_STORAGE_ACCOUNT_KEY")
    if key:
        plan.env.update(key)
    else:  # DefaultAzureCredential picks up the federated token the workload-identity webhook injects
        plan.workload_identity = True
    return plan


def _triton(spec: ServingSpec, opts: AksOptions) -> RepoPlan:
    repo, env = spec.model_repository, spec.environment_variables
    scheme = repo.split("://")[0]
    if scheme in ("s3", "gs"):
        return RepoPlan(uri=repo)  # Triton reads them with the credentials the spec's environment gives it
    if scheme == "az":
        container, path = _az_parts(repo)
        account = opts.storage_account or env.get("AZURE_STORAGE_ACCOUNT") or env.get("AZURE_STORAGE_ACCOUNT_NAME")
        if not account:
            raise DeployError(f"Triton reads Azure Storage as as://ACCOUNT/CONTAINER/PATH; {repo} does not say "
                              "which account", where="model_repository",
                              fix=f"pass --storage-account ACCOUNT (it becomes as://ACCOUNT/{container}/{path}), or "
                                  f"write model_repository: as://ACCOUNT/{container}/{path}")
        repo = f"as://{account}/{container}/{path}".rstrip("/")
    elif scheme == "as":
        if not _AS_URI.fullmatch(repo):
            raise DeployError(f"{repo} is not an Azure Storage URI as Triton reads it", where="model_repository",
                              fix="write as://ACCOUNT/CONTAINER/PATH (ACCOUNT: the storage account's name)")
    else:
        raise DeployError(f"Triton cannot read {scheme}:// repositories (it reads as://, s3://, gs:// and local "
                          "folders in its container)", where="model_repository",
                          fix="upload the repository to Blob and use az://CONTAINER/PATH (with --storage-account) or "
                              "as://ACCOUNT/CONTAINER/PATH")
    plan = RepoPlan(uri=repo)
    if "AZURE_STORAGE_KEY" in env:
        return plan
    key = _key_env(spec, opts, "AZURE_STORAGE_KEY")
    if not key:
        raise DeployError(
            f"Triton needs the storage account's key to read {repo}: Triton 24.01 reads Azure Storage with a key "
            "or anonymously, not with a workload identity", where="model_repository",
            fix="create a Secret holding the key (kubectl create secret generic models-storage --from-literal="
                f"{SECRET_KEY}=KEY) and pass --storage-key-secret models-storage")
    plan.env.update(key)
    return plan


def repository_plan(spec: ServingSpec, opts: AksOptions) -> RepoPlan:
    """The repository as ``spec.server`` reads it in the pod, and what it needs; refused with the fix when no
    pod could read it."""
    bad = _local_or_asset(spec)
    if bad is not None:
        raise bad
    return _triton(spec, opts) if spec.server == "triton" else _azulite(spec, opts)
