"""How a job's code, environment and image reach a pod.

- The image: ``--image`` or the spec's ``environment.image``. An Azure ML curated environment
  (``azureml:AzureML-acpt-pytorch-2.2-cuda12.1@latest``, or the ``azureml://registries/azureml/...`` form)
  is published as an image on MCR (``mcr.microsoft.com/azureml/curated/<name>:<version>``, the image
  Azure ML itself runs): it is the pod's image, or the base the Dockerfile builds on. A workspace's own
  environment (``azureml:my-env:3``) exists only there, so an AKS target needs an image of its own.
- A Dockerfile is rendered beside the manifests when the environment names a conda file or the code
  folder has a requirements.txt, or the job is an MPI job (its pods run sshd and ssh: OpenSSH is added,
  configured as the mpi-operator's images are), and then ``--image`` names the image it builds; or when
  ``--image`` is given without ``--code-uri`` (the code is baked in): ``docker build -t IMAGE -f Dockerfile
  CODE`` builds what the manifests run.
- The code: with ``--code-uri az://container/prefix`` it is uploaded as ``<prefix>/<job>/code.tar.gz`` at
  submit and fetched by an init container (Azure CLI, logged in through workload identity) into an
  emptyDir at /code; otherwise it is in the image at /code (the Dockerfile's ``COPY``, or an image of
  yours that already holds it, as seed 002's manifests assume).
"""

from __future__ import annotations

import re
from pathlib import Path

from azulite.deploy.options import CODE_DIR, AksOptions
from azulite.errors import DeployError
from azulite.spec.job import Environment, JobSpec

#: the base the seeds run on (seed 002): CUDA 12.1, cuDNN 8, Open MPI; Azure ML's own training base
DEFAULT_BASE = "mcr.microsoft.com/azureml/openmpi4.1.0-cuda12.1-cudnn8-ubuntu22.04"
AZ_CLI_IMAGE = "mcr.microsoft.com/azure-cli:2.67.0"
CODE_ARCHIVE = "code.tar.gz"
#: OpenSSH for an MPIJob, set up as kubeflow/mpi-operator's base image sets it (build/base/Dockerfile): no
#: host key checks (every pod is new), no known_hosts to write (the key folder is a read-only Secret), no
#: StrictModes (the Secret's files are not the user's); and the image's PATH/LD_LIBRARY_PATH in
#: /etc/environment, which sshd's sessions read (else orted and python would not be found over ssh)
SSH_LAYER = [
    "RUN apt-get update && apt-get install -y --no-install-recommends openssh-server openssh-client "
    "&& rm -rf /var/lib/apt/lists/* && mkdir -p /var/run/sshd",
    "RUN sed -i 's/[ #]\\(.*StrictHostKeyChecking \\).*/ \\1no/g' /etc/ssh/ssh_config "
    "&& echo '    UserKnownHostsFile /dev/null' >> /etc/ssh/ssh_config "
    "&& sed -i 's/#\\(StrictModes \\).*/\\1no/g' /etc/ssh/sshd_config "
    "&& env | grep -E '^(PATH|LD_LIBRARY_PATH)=' >> /etc/environment",
]


#: where Azure ML publishes its curated environments' images (azureml-assets: ``image.name:
#: azureml/curated/<asset>``, ``publish.location: mcr``), tagged with the asset's version and ``latest``
CURATED_REGISTRY = "mcr.microsoft.com/azureml/curated"
_CURATED = (
    # azureml:AzureML-<name>@latest | azureml:AzureML-<name>:<version>  (the curated names in every workspace)
    re.compile(r"azureml:AzureML-(?P<name>[A-Za-z0-9][\w.-]*?)(?:@(?P<label>latest)|:(?P<version>\d+))?"),
    # azureml://registries/azureml/environments/<name>/versions/<v> | /labels/latest  (the registry's own URI)
    re.compile(r"azureml://registries/azureml/environments/(?P<name>[A-Za-z0-9][\w.-]*)"
               r"(?:/versions/(?P<version>\d+)|/labels/(?P<label>latest))?"),
)


def curated_image(environment: str) -> str | None:
    """The MCR image of an Azure ML curated environment reference, or None for any other reference.

    ``azureml:AzureML-acpt-pytorch-2.2-cuda12.1@latest`` ->
    ``mcr.microsoft.com/azureml/curated/acpt-pytorch-2.2-cuda12.1:latest`` (image names are lowercase)."""
    for pattern in _CURATED:
        m = pattern.fullmatch(environment.strip())
        if m:
            return f"{CURATED_REGISTRY}/{m['name'].lower()}:{m['version'] or 'latest'}"
    return None


def _base_image(spec: JobSpec) -> str:
    """What the rendered Dockerfile builds on: the spec's image, its curated environment's, or DEFAULT_BASE."""
    env = spec.environment
    if isinstance(env, Environment) and env.image:
        return env.image
    if isinstance(env, str):
        return curated_image(env) or (env if not env.startswith("azureml:") and "/" in env else DEFAULT_BASE)
    return DEFAULT_BASE


def _build_reason(spec: JobSpec) -> tuple[str, str] | None:
    """Why the job's image must be built from the rendered Dockerfile, if it must, and the spec's field."""
    env = spec.environment
    if isinstance(env, Environment) and env.conda_file or (Path(spec.code) / "requirements.txt").is_file():
        return "the environment has a conda file or requirements.txt", "environment"
    if spec.distribution_type == "mpi":
        return ("an MPI job's pods run sshd and ssh (mpirun reaches its workers through them), which the base "
                "image lacks", "distribution.type")
    return None


def container_image(spec: JobSpec, opts: AksOptions) -> str:
    if opts.image:
        return opts.image
    build = _build_reason(spec)
    if build:
        raise DeployError(
            f"{build[0]}: the image to run is built from the rendered Dockerfile", where=build[1],
            fix="pass --image REGISTRY/NAME:TAG, the tag you build and push the Dockerfile as",
        )
    env = spec.environment
    if isinstance(env, Environment) and env.image:
        return env.image
    if isinstance(env, str) and not env.startswith("azureml") and "/" in env:
        return env  # a plain image reference
    curated = curated_image(env) if isinstance(env, str) else None
    if curated:
        if opts.code_uri:
            return curated  # the code comes from the init container; the curated image runs as it is
        raise DeployError(
            f"{env!r} is Azure ML's curated image {curated}, which does not hold the job's code",
            where="environment",
            fix="pass --image REGISTRY/NAME:TAG (the rendered Dockerfile builds it FROM that image with the code "
                "at /code), or --code-uri az://container/prefix --storage-account ACCOUNT to fetch the code at start",
        )
    shown = env if isinstance(env, str) else (env.conda_file or env.name) if env else None
    raise DeployError(
        "no image to run" + (f": {shown!r} is not an image a pod can pull (a workspace's own environment "
                             "exists only in Azure ML)" if shown else ""),
        where="environment",
        fix="set environment.image (e.g. mcr.microsoft.com/azureml/curated/acpt-pytorch-2.2-cuda12.1:latest), "
            "or pass --image REGISTRY/NAME:TAG and build it from the rendered Dockerfile",
    )


def code_archive_uri(opts: AksOptions, job: str) -> str:
    assert opts.code_uri
    return f"{opts.code_uri.rstrip('/')}/{job}/{CODE_ARCHIVE}"


def code_init_container(opts: AksOptions, job: str) -> dict:
    """Downloads and unpacks the code snapshot uploaded at submit (see ``azulite.launch.kubernetes``)."""
    uri = code_archive_uri(opts, job)
    if not uri.startswith("az://"):
        raise DeployError(f"--code-uri must be an az://container/prefix URI, got {opts.code_uri!r}", where="--code-uri",
                          fix="pass --code-uri az://container/prefix")
    if not opts.storage_account:
        raise DeployError("an az:// code location needs its storage account", where="--storage-account",
                          fix="pass --storage-account ACCOUNT (the account holding the container)")
    container, _, blob = uri[len("az://"):].partition("/")
    script = (
        'az login --service-principal -u "$AZURE_CLIENT_ID" -t "$AZURE_TENANT_ID" '
        '--federated-token "$(cat $AZURE_FEDERATED_TOKEN_FILE)" >/dev/null && '
        f"az storage blob download --auth-mode login --account-name {opts.storage_account} "
        f"-c {container} -n {blob} -f /tmp/{CODE_ARCHIVE} >/dev/null && tar -xzf /tmp/{CODE_ARCHIVE} -C {CODE_DIR}"
    )
    return {"name": "fetch-code", "image": AZ_CLI_IMAGE, "command": ["bash", "-c", script],
            "volumeMounts": [{"name": "code", "mountPath": CODE_DIR}]}


def dockerfile(spec: JobSpec, opts: AksOptions) -> str | None:
    """The Dockerfile that builds the job's image, or None when the spec's image runs as it is."""
    env = spec.environment
    conda = env.conda_file if isinstance(env, Environment) else None
    requirements = (Path(spec.code) / "requirements.txt").is_file()
    bake = opts.code_uri is None and opts.image is not None
    ssh = spec.distribution_type == "mpi"
    if not (conda or requirements or bake or ssh):
        return None
    base = _base_image(spec)
    lines = [f"# Builds the image of job {spec.name}: docker build -t {opts.image or 'REGISTRY/NAME:TAG'} -f Dockerfile CODE_FOLDER",
             f"FROM {base}"]
    if conda:
        lines += [f"COPY {Path(conda).name} /tmp/conda.yaml",
                  "RUN conda env update -n base -f /tmp/conda.yaml && conda clean -afy"]
    if requirements:
        lines += ["COPY requirements.txt /tmp/requirements.txt", "RUN pip install --no-cache-dir -r /tmp/requirements.txt"]
    if ssh:
        lines += SSH_LAYER
    if bake:
        lines += [f"COPY . {CODE_DIR}"]
    lines += [f"WORKDIR {CODE_DIR}"]
    return "\n".join(lines) + "\n"
