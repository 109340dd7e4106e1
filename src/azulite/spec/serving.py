"""The serving spec: a model repository behind N replicas of ``azulite serve`` or Triton, autoscaled, on
AKS or an Azure ML managed endpoint. YAML read like the job spec: typed, validated when read, errors
naming file, line and fix.

A file is a serving spec when it has ``model_repository``, a cluster spec (``azulite.spec.cluster``) when
it has ``pools``, a job spec otherwise.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from azulite.deploy.quantity import parse_quantity, resource_quantity
from azulite.errors import SpecError
from azulite.spec.yaml_text import dotted, parse

_NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")  # a Kubernetes Service name (DNS-1035 label)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Autoscaling(_Model):
    """An autoscaling/v2 HPA on CPU utilisation (seed 001 §4.2); on Azure ML, the deployment's
    instance range."""

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=5, ge=1)
    target_cpu_utilization: int = Field(default=70, ge=1, le=100)

    @model_validator(mode="after")
    def _range(self) -> "Autoscaling":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})")
        return self


class ServingResources(_Model):
    """Per replica, Kubernetes quantities (``4``, ``500m``; ``16Gi``). ``gpus`` defaults to 1 on a GPU VM
    size, 0 elsewhere; ``cpu``/``memory`` are limits, ``*_request`` requests (a limit alone is also the
    request, as Kubernetes reads it)."""

    gpus: int | None = Field(default=None, ge=0)
    cpu: str | None = None
    memory: str | None = None
    cpu_request: str | None = None
    memory_request: str | None = None

    @field_validator("cpu", "memory", "cpu_request", "memory_request", mode="before")
    @classmethod
    def _quantity(cls, v: Any) -> Any:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = str(v)  # `cpu: 4` reads as the quantity "4"
        if isinstance(v, str):
            resource_quantity(v)
        return v

    @model_validator(mode="after")
    def _request_within_limit(self) -> "ServingResources":
        for what, limit, request in (("cpu", self.cpu, self.cpu_request), ("memory", self.memory, self.memory_request)):
            if limit and request and parse_quantity(request) > parse_quantity(limit):
                # the API server refuses it: "must be less than or equal to <what> limit"
                raise ValueError(f"{what}_request ({request}) is above the {what} limit ({limit}): Kubernetes "
                                 f"refuses a request above its limit")
        return self


class ServingSpec(_Model):
    """``model_repository``, as each target reads it (``azulite.deploy.serving`` and ``.azureml`` check it):

    - ``az://container/path`` (Blob): ``azulite serve`` mirrors it itself; for Triton on AKS it becomes
      Triton's ``as://ACCOUNT/container/path``; on Azure ML, a path on the datastore of that container.
    - ``as://account/container/path``, ``s3://``, ``gs://``: URIs Triton reads itself (AKS, ``server: triton``).
    - ``azureml:NAME:VERSION`` / ``azureml://...``: an Azure ML model asset or datastore path (Azure ML only).
    - a local folder (relative to the spec file): uploaded by ``az ml online-deployment create`` (Azure ML
      only: a pod on AKS cannot see this machine's disk)."""

    name: str
    model_repository: str = Field(min_length=1)
    server: Literal["azulite", "triton"] = "azulite"
    image: str | None = None
    args: list[str] = Field(default_factory=list)
    replicas: int = Field(default=1, ge=0)
    autoscaling: Autoscaling | None = None
    instance_type: str | None = None
    node_pool: str | None = None
    priority: Literal["dedicated", "spot"] = "dedicated"
    resources: ServingResources = Field(default_factory=ServingResources)
    environment_variables: dict[str, str] = Field(default_factory=dict)
    #: Azure ML managed endpoint: key or aml_token auth
    auth_mode: Literal["key", "aml_token"] = "key"
    #: Azure ML model asset name/version of the repository (type triton_model)
    model_name: str | None = None
    model_version: str = "1"

    @field_validator("name")
    @classmethod
    def _k8s_name(cls, v: str) -> str:
        # it names the Deployment, the Service (a DNS-1035 label) and the endpoint
        if not _NAME.fullmatch(v):
            raise ValueError(f"{v!r} is not a Kubernetes Service name: lowercase letters, digits and '-', a letter "
                             f"first, a letter or digit last, at most 63 characters")
        return v


def _line_of(node: yaml.Node | None, path: tuple) -> int | None:
    line = None
    for part in path:
        if isinstance(node, yaml.MappingNode):
            nxt = next(((k, v) for k, v in node.value if k.value == part), None)
            if nxt is None:
                break
            line, node = nxt[0].start_mark.line + 1, nxt[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def spec_kind(data: Any) -> str:
    """``serving``, ``cluster`` or ``job`` for a parsed YAML mapping."""
    if isinstance(data, dict) and "model_repository" in data:
        return "serving"
    if isinstance(data, dict) and "pools" in data:
        return "cluster"
    return "job"


def read_yaml(path: str | Path) -> tuple[Any, yaml.Node | None]:
    shown = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise SpecError("spec not found", file=shown, fix="check the path") from None
    except IsADirectoryError:
        raise SpecError("is a directory, not a spec file", file=shown, fix="pass the YAML file itself") from None
    except (PermissionError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read the spec ({exc.__class__.__name__})", file=shown, fix="pass a readable YAML file") from None
    return parse(text, shown)


def load_model(path: str | Path, model: type[BaseModel], overrides: Iterable[str] = ()) -> Any:
    """Read ``path`` as ``model`` (ServingSpec); every error names the line and field."""
    from azulite.spec.loader import _apply_override, parse_overrides

    data, node = read_yaml(path)
    if not isinstance(data, dict):
        raise SpecError("a spec must be a YAML mapping", file=str(path), line=1, value=data, fix="write `key: value` lines")
    over = parse_overrides(overrides)
    for p, value, item in over:
        _apply_override(data, p, value, item)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            field = dotted(loc)
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg, fix = f"unknown field '{loc[-1]}'", "remove it (see the Deploy section of README.md for the fields)"
            elif err["type"] == "missing":
                msg, fix = f"required field '{field}' is missing", f"add `{loc[-1]}: ...`"
            else:
                fix = f"correct {field or 'the spec'} (see the Deploy section of README.md)"
            set_item = next((item for p, _, item in over if loc[: len(p)] == p or p[: len(loc)] == loc), None)
            where = dict(file=f"--set {set_item}") if set_item else dict(file=str(path), line=_line_of(node, loc))
            problems.append(SpecError(msg, field=field or None, fix=fix, **where))
        first = problems[0]
        if len(problems) > 1:
            first.fix = (first.fix or "") + "".join(f"\n  also: {p.where}: {p.message}" for p in problems[1:])
        raise first from None
