"""The job spec: a distributed training job in the shape of an Azure ML command job (YAML).

Typed pydantic models, validated when read (``azulite.spec.loader.load_job``), never when used. Azure
ML's own bookkeeping keys (``$schema``, ``type: command``, ``compute``, ``experiment_name``,
``display_name``, ``tags``, ...) are accepted and kept; any other unknown key is an error (a typo would
otherwise silently do nothing).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Azure ML command-job keys azulite accepts and records but does not act on.
AZUREML_KEYS = frozenset(
    {
        "$schema", "type", "compute", "experiment_name", "display_name", "description", "tags",
        "properties", "identity", "services", "queue_settings", "limits", "is_deterministic",
        "status", "creation_context", "id", "parent_job_name",
    }
)

#: Azure ML's queue_settings.job_tier values (azure-ai-ml's JobTier; case-insensitive)
JOB_TIERS = ("spot", "basic", "standard", "premium", "null")
_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,99}$"
#: the most nodes a spec may ask for (more than any Azure ML or AKS cluster runs: a typo, or a number not meant
#: as a count); the local backend's own limit is the machine's (``azulite.launch.local.capacity``)
MAX_NODES = 10_000
#: the most processes per node (one per GPU, or per core for a CPU MPI job: Azure's largest VMs have 176)
MAX_PROCESSES_PER_NODE = 1024
#: the most TensorFlow workers or parameter servers (a whole job's, not a node's)
MAX_TASKS = 100_000
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


class FieldCheck(ValueError):
    """A check across fields that failed, with its own fix and the field it is placed at (pydantic keeps the
    exception in the error's ``ctx``; ``azulite.spec.loader`` reads both). ``field``: the path below the
    location pydantic reports (the model's, or a field validator's field), a dotted str or a tuple. A fix
    names the file's key and the ``--set`` that does the same, since either may have caused it."""

    def __init__(self, message: str, *, fix: str, field: str | tuple | None = None) -> None:
        super().__init__(message)
        self.fix, self.field = fix, field


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    # counts (nodes, processes, retries) are strict: YAML's `true` is not 1 node


class PathInput(_Model):
    """A file or folder input: ``{type: uri_file|uri_folder, path: ...}``. A local path is resolved
    against the spec file's folder and must exist; remote URIs (az://, azureml://, https://) are kept."""

    type: Literal["uri_file", "uri_folder", "mlflow_model", "custom_model", "mltable"] = "uri_folder"
    path: str = Field(min_length=1)
    #: Azure ML's input modes (azure-ai-ml's InputSchema): a typo would pass here and be refused there
    mode: Literal["ro_mount", "download", "direct", "eval_mount", "eval_download"] | None = None


class Output(_Model):
    """A job output; ``path`` defaults to ``<job dir>/outputs/<name>`` (local backend)."""

    type: Literal["uri_folder", "uri_file", "mlflow_model", "custom_model"] = "uri_folder"
    path: str | None = None
    #: Azure ML's output modes (OutputSchema); locally, upload / rw_mount / mount copy a remote output up
    mode: Literal["rw_mount", "upload", "mount", "direct"] | None = None

    def location(self, job_dir: str | Path, name: str) -> str:
        """Where this output goes for a job whose directory is ``job_dir``."""
        return self.path or str(Path(job_dir) / "outputs" / name)


Literal_ = Union[bool, int, float, str]
InputValue = Union[PathInput, Literal_]


class Environment(_Model):
    """The image or conda file a job runs in. Recorded in the store and handed to cloud targets; the
    local backend runs in the current Python environment."""

    name: str | None = None
    version: str | None = None
    image: str | None = None
    conda_file: str | None = None
    build: dict | None = None
    description: str | None = None


class Resources(_Model):
    """Azure ML's job resources. ``docker_args``, ``locations`` and ``max_instance_count`` are Azure ML's
    own: rendered for Azure ML, not applied here (no container, one machine); on AKS ``docker_args`` is
    refused (Kubernetes runs no ``docker run``)."""

    instance_type: str | None = None
    instance_count: int | None = Field(default=None, ge=1, le=MAX_NODES, strict=True)
    shm_size: str | None = None
    properties: dict | None = None
    docker_args: str | list[str] | None = None
    locations: list[str] | None = None
    max_instance_count: int | None = Field(default=None, ge=1, le=MAX_NODES, strict=True)


class PyTorchDistribution(_Model):
    """torchrun-style: ``instance_count`` nodes x ``process_count_per_instance`` processes (one per GPU).
    DeepSpeed jobs use this too (seed 001 §1.3), passing ``--deepspeed_config FILE`` in the command."""

    type: Literal["pytorch"]
    process_count_per_instance: int = Field(default=1, ge=1, le=MAX_PROCESSES_PER_NODE, strict=True)


class TensorFlowDistribution(_Model):
    """MultiWorkerMirroredStrategy / ParameterServerStrategy: one process per worker, TF_CONFIG set."""

    type: Literal["tensorflow"]
    worker_count: int = Field(default=1, ge=1, le=MAX_TASKS, strict=True)
    parameter_server_count: int = Field(default=0, ge=0, le=MAX_TASKS, strict=True)


class MpiDistribution(_Model):
    type: Literal["mpi"]
    process_count_per_instance: int = Field(default=1, ge=1, le=MAX_PROCESSES_PER_NODE, strict=True)


class Elastic(_Model):
    """A range of nodes the job runs on (azulite's own field: Azure ML's command job takes only an integer
    ``instance_count``, so this stays local and on AKS). ``instance_count`` nodes start; the job goes on
    while ``min_nodes`` of them are left (torchrun ``--nnodes=MIN:MAX``; Kubeflow's PyTorchJob
    ``elasticPolicy.minReplicas``/``maxReplicas``). Bitwise equality with an uninterrupted run holds at a
    fixed world size only: a job that asks for a range trades it for progress."""

    min_nodes: int = Field(ge=1, le=MAX_NODES, strict=True)
    max_nodes: int | None = Field(default=None, ge=1, le=MAX_NODES, strict=True)


Distribution = Annotated[
    Union[PyTorchDistribution, TensorFlowDistribution, MpiDistribution], Field(discriminator="type")
]
DISTRIBUTION_TYPES = ("pytorch", "tensorflow", "mpi")


DURATION_FIX = "write seconds (5400) or one number with a unit: 90s, 30m, 2h, 1.5h, 2d (no timeout: leave it out)"


def parse_duration(value: Any) -> float:
    """Seconds from 3600, "3600", "90s", "30m", "2h", "1d"."""
    if isinstance(value, bool):
        raise ValueError("a duration, not a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION_RE.match(str(value))
        if not m:
            raise ValueError("not a duration")
        seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    if seconds <= 0:
        raise ValueError("a duration must be > 0")
    return seconds


class JobSpec(_Model):
    """A command job. ``command`` runs once per process with ``${{inputs.NAME}}`` / ``${{outputs.NAME}}``
    substituted; ``code`` is its working directory (snapshotted at submit, copied per node)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(default="job", pattern=_NAME_RE)
    code: str = "."
    command: str = Field(min_length=1)
    inputs: dict[str, InputValue] = Field(default_factory=dict)
    outputs: dict[str, Output] = Field(default_factory=dict)
    environment: Union[str, Environment, None] = None
    environment_variables: dict[str, str] = Field(default_factory=dict)
    resources: Resources = Field(default_factory=Resources)
    instance_count: int | None = Field(default=None, ge=1, le=MAX_NODES, strict=True)
    distribution: Distribution | None = None
    #: a range of nodes instead of exactly ``instance_count`` (pytorch only); see :class:`Elastic`
    elastic: Elastic | None = None
    priority: Literal["dedicated", "spot"] = "dedicated"
    timeout: float | None = None
    max_retries: int = Field(default=0, ge=0, strict=True)
    max_restarts: int = Field(default=0, ge=0, strict=True)
    #: Azure ML keys kept as-is (see AZUREML_KEYS)
    azureml: dict[str, Any] = Field(default_factory=dict, exclude=False)

    @model_validator(mode="before")
    @classmethod
    def _split_azureml_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        kept = {k: data.pop(k) for k in list(data) if k in AZUREML_KEYS}
        if kept:
            data["azureml"] = {**data.get("azureml", {}), **kept}
            limits = kept.get("limits")
            if isinstance(limits, dict) and "timeout" in limits and "timeout" not in data:
                data["timeout"] = limits["timeout"]
            queue = kept.get("queue_settings")  # Azure ML's own way to ask for spot capacity
            if isinstance(queue, dict) and str(queue.get("job_tier", "")).lower() == "spot" and "priority" not in data:
                data["priority"] = "spot"
        dist = data.get("distribution")
        if isinstance(dist, dict) and isinstance(dist.get("type"), str):
            data["distribution"] = {**dist, "type": dist["type"].lower()}
        if isinstance(data.get("inputs"), dict):
            # `{type: integer, default: 3}` / `{value: 3}` literal forms of Azure ML -> the value itself
            data["inputs"] = {
                k: (v.get("value", v.get("default")) if isinstance(v, dict) and ("value" in v or "default" in v) else v)
                for k, v in data["inputs"].items()
            }
        return data

    @field_validator("environment_variables", mode="before")
    @classmethod
    def _env_values_as_strings(cls, v: Any) -> Any:
        if isinstance(v, dict):  # YAML's numbers as names too (`1: x` was refused as if its value were wrong)
            return {(str(k) if isinstance(k, (int, float)) and not isinstance(k, bool) else k):
                    (str(x).lower() if isinstance(x, bool) else str(x)) if isinstance(x, (int, float, bool)) else x
                    for k, x in v.items()}
        return v

    @field_validator("environment_variables", mode="after")
    @classmethod
    def _env_names_the_os_takes(cls, v: dict[str, str]) -> dict[str, str]:
        """Names and values a process environment can hold, checked here (they failed inside the supervisor:
        "illegal environment variable name"); no ``${{...}}`` (azulite fills none here, and the process saw
        the text); MASTER_PORT a port (refused only at submit before)."""
        for name, value in v.items():
            if not name or "=" in name or "\0" in name:
                raise FieldCheck(f"{name!r} is not an environment variable name (empty, or with '=' or NUL)",
                                 field=(name,), fix="name it with letters, digits and '_', e.g. MY_SETTING")
            if "\0" in value:
                raise FieldCheck(f"{name}'s value holds a NUL character, which no process environment can hold",
                                 field=(name,), fix="remove the NUL character from the value")
            if "${{" in value:
                raise FieldCheck(f"{name}: {value!r}: azulite fills no ${{{{...}}}} in environment_variables (the "
                                 "process would see the text)", field=(name,),
                                 fix="pass the value in the command instead, e.g. "
                                     "command: python train.py --lr ${{inputs.lr}}")
        port = v.get("MASTER_PORT")
        if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
            raise FieldCheck(f"MASTER_PORT {port!r} is not a TCP port (1-65535)", field=("MASTER_PORT",),
                             fix='give a port, e.g. MASTER_PORT: "29500", or leave it out (a free one is chosen)')
        return v

    @field_validator("timeout", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        return None if v is None else parse_duration(v)

    @model_validator(mode="after")
    def _instance_count_agrees(self) -> "JobSpec":
        top, res = self.instance_count, self.resources.instance_count
        if top is not None and res is not None and top != res:
            raise FieldCheck(
                f"instance_count ({top}) and resources.instance_count ({res}) disagree; set one of them",
                fix="give the node count once: set resources.instance_count (e.g. --set resources.instance_count=1) "
                    "and drop the top-level instance_count, or make the two equal")
        return self

    @model_validator(mode="after")
    def _azure_ml_settings_agree(self) -> "JobSpec":
        """Azure ML's own fields for what azulite's say too: a job tier Azure ML would refuse, or one that
        disagrees with ``priority``; a ``limits.timeout`` that disagrees with ``timeout`` (each was taken
        silently, one of them lost)."""
        queue = self.azureml.get("queue_settings")
        if queue is not None and not isinstance(queue, dict):
            raise FieldCheck(f"queue_settings must be a mapping (got {queue!r})", field="queue_settings",
                             fix="write queue_settings: {job_tier: spot} (or --set queue_settings.job_tier=spot), "
                                 "or leave it out")
        tier = (queue or {}).get("job_tier")
        if tier is not None:
            kind = str(tier).lower()
            if kind not in JOB_TIERS:
                raise FieldCheck(f"queue_settings.job_tier {tier!r} is not an Azure ML job tier "
                                 f"({', '.join(JOB_TIERS)})", field="queue_settings.job_tier",
                                 fix=f"use one of: {', '.join(JOB_TIERS)} (e.g. --set queue_settings.job_tier=spot)")
            if kind != "null" and (kind == "spot") != (self.priority == "spot"):
                want = "spot" if self.priority == "spot" else "standard"
                raise FieldCheck(f"queue_settings.job_tier ({tier}) and priority ({self.priority}) disagree; "
                                 "set one of them", field="queue_settings.job_tier",
                                 fix=f"say it once: keep priority: {self.priority} and remove queue_settings.job_tier, "
                                     f"or make them agree (--set queue_settings.job_tier={want}, or --set "
                                     f"priority={'spot' if kind == 'spot' else 'dedicated'})")
        limits = self.azureml.get("limits")
        if isinstance(limits, dict) and limits.get("timeout") is not None:
            try:
                given = parse_duration(limits["timeout"])
            except ValueError as exc:
                raise FieldCheck(f"limits.timeout: {exc}", field="limits.timeout", fix=DURATION_FIX) from None
            if given != self.timeout:
                said = "none" if self.timeout is None else f"{self.timeout:g} s"
                raise FieldCheck(f"limits.timeout ({limits['timeout']}) and timeout ({said}) disagree; "
                                 "set one of them", field="limits.timeout",
                                 fix="give the timeout once: keep timeout and remove limits.timeout (Azure ML's "
                                     "spelling of the same), or make them equal (e.g. --set limits.timeout="
                                     f"{'null' if self.timeout is None else f'{self.timeout:g}'})")
        return self

    @model_validator(mode="after")
    def _restarts_are_torchruns(self) -> "JobSpec":
        if self.max_restarts and self.distribution_type != "pytorch":  # nothing would restart: said, not dropped
            kind = "a job without distribution" if self.distribution is None else f"a {self.distribution_type} job"
            raise FieldCheck(f"max_restarts ({self.max_restarts}) restarts torchrun's workers in place (distribution "
                             f"type pytorch); {kind} is retried whole: use max_retries", field="max_restarts",
                             fix=f"remove max_restarts (--set max_restarts=0) and retry whole attempts with "
                                 f"max_retries (--set max_retries={self.max_restarts}), or use distribution type pytorch")
        return self

    @model_validator(mode="after")
    def _elastic_range(self) -> "JobSpec":
        e = self.elastic
        if e is not None:
            if self.distribution_type != "pytorch":
                raise FieldCheck("elastic node ranges need distribution type pytorch (torchrun)", field="elastic",
                                 fix="remove elastic (--set elastic=null) to run a fixed node count, or use "
                                     "distribution type pytorch")
            top = e.max_nodes if e.max_nodes is not None else self.nodes
            if top != self.nodes:
                raise FieldCheck(f"elastic.max_nodes ({top}) must equal instance_count ({self.nodes}): the nodes started",
                                 field="elastic.max_nodes",
                                 fix=f"leave elastic.max_nodes out (it is instance_count) or set it to {self.nodes} "
                                     f"(--set elastic.max_nodes={self.nodes}); to start {top} nodes, --set "
                                     f"resources.instance_count={top}")
            if e.min_nodes > top:
                raise FieldCheck(f"elastic.min_nodes ({e.min_nodes}) is above max_nodes ({top})", field="elastic.min_nodes",
                                 fix=f"set elastic.min_nodes to {top} or fewer (--set elastic.min_nodes=1): the job "
                                     "goes on while that many nodes are left")
        return self

    @property
    def node_range(self) -> tuple[int, int]:
        """(min, max) nodes: (n, n) unless ``elastic`` asks for a range."""
        return (self.elastic.min_nodes, self.nodes) if self.elastic else (self.nodes, self.nodes)

    # ---- derived facts the launchers use -------------------------------------------------------------
    @property
    def nodes(self) -> int:
        """Number of (simulated) nodes: ``resources.instance_count`` or ``instance_count``, default 1."""
        return self.resources.instance_count or self.instance_count or 1

    @property
    def distribution_type(self) -> str:
        """The distribution's type; "none" without one (the command runs once per node, see README)."""
        return self.distribution.type if self.distribution else "none"

    @property
    def processes_per_node(self) -> int:
        d = self.distribution
        if d is None:
            return 1
        if isinstance(d, TensorFlowDistribution):
            return 1
        return d.process_count_per_instance

    @property
    def world_size(self) -> int:
        d = self.distribution
        if isinstance(d, TensorFlowDistribution):
            return d.worker_count
        return self.nodes * self.processes_per_node

    @property
    def environment_label(self) -> str | None:
        env = self.environment
        if env is None or isinstance(env, str):
            return env
        return env.image or env.conda_file or env.name
