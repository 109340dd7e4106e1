"""The cluster spec: node pools (SKU, min/max nodes, labels, taints, spot with an eviction rate) and the
cluster autoscaler's timings, read from YAML like the job spec (errors name file, line and field).

    name: gpu-cluster
    autoscaler:
      scale_up_delay: 5m               # VM provisioning until the node is Ready
      scale_down_unneeded_time: 10m    # seed 001 §2.6 (cluster-autoscaler's scale-down-unneeded-time)
      scale_down_delay_after_add: 10m  # seed 001 §2.6
    pools:
      - name: gpunp
        sku: Standard_NC24rs_v3
        min_nodes: 0
        max_nodes: 4
        labels: {agentpool: gpunp}
      - name: gpuspot
        sku: Standard_NC24rs_v3
        spot: true
        eviction_rate_per_hour: 0.01
        max_nodes: 8
        taints: ["kubernetes.azure.com/scalesetpriority=spot:NoSchedule"]
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from azulite.errors import SpecError
from azulite.spec import labels
from azulite.spec.job import parse_duration
from azulite.spec.loader import _data_path, _describe, _Source
from azulite.spec.yaml_text import dotted, line_map, parse

#: Spot evictions per node-hour when a pool gives none. No seed and no Microsoft page we could read gives
#: an eviction rate (Azure shows a per-region bucket in the portal only): this is azulite's assumption,
#: 1% per node-hour (one eviction per ~100 node-hours). Set ``eviction_rate_per_hour`` from what you observe.
DEFAULT_EVICTION_RATE_PER_HOUR = 0.01
DEFAULT_EVICTION_RATE_SOURCE = "azulite assumption (no published rate): 0.01 evictions per node-hour"

#: Well-known taint of AKS spot pools (seed 001 §2.6, "Spot Pod Toleration").
SPOT_TAINT = "kubernetes.azure.com/scalesetpriority=spot:NoSchedule"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _seconds(v: Any) -> Any:
    return parse_duration(v) if v is not None else v


class Taint(_Model):
    """``key=value:Effect`` (Kubernetes); only NoSchedule/NoExecute keep pods off."""

    key: str
    value: str = ""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"

    @classmethod
    def parse(cls, text: str) -> "Taint":
        kv, _, effect = text.partition(":")
        key, _, value = kv.partition("=")
        if not key or not effect:
            raise ValueError(f"a taint is key=value:Effect, e.g. {SPOT_TAINT}")
        if effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise ValueError(f"taint {text}: the effect is NoSchedule, PreferNoSchedule or NoExecute, not {effect!r}")
        problem = labels.key_problem(key) or labels.value_problem(value)
        if problem:
            raise ValueError(f"taint {text}: {problem} ({labels.RULE})")
        return cls(key=key, value=value, effect=effect)

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}"

    @model_validator(mode="after")
    def _syntax(self) -> "Taint":
        problem = labels.key_problem(self.key) or labels.value_problem(self.value)
        if problem:
            raise ValueError(f"taint {self.key}={self.value}: {problem} ({labels.RULE})")
        return self


class NodePool(_Model):
    #: an AKS Linux node pool name (1-12 lowercase letters and digits, a letter first): `cluster render`
    #: makes pools by it, so a name that simulates but cannot be created is refused here
    name: str = Field(pattern=r"^[a-z][a-z0-9]{0,11}$")
    sku: str = Field(min_length=1)
    min_nodes: int = Field(default=0, ge=0)
    max_nodes: int = Field(default=1, ge=1)
    #: nodes at the start (default: min_nodes)
    initial_nodes: int | None = Field(default=None, ge=0)
    labels: dict[str, str] = Field(default_factory=dict)
    taints: list[Taint] = Field(default_factory=list)
    spot: bool = False
    #: spot evictions per node-hour (default DEFAULT_EVICTION_RATE_PER_HOUR, labelled as an assumption)
    eviction_rate_per_hour: float | None = Field(default=None, ge=0)
    #: which price applies to a non-spot pool
    pricing: Literal["on_demand", "reserved_1y", "reserved_3y", "savings_1y", "savings_3y"] = "on_demand"

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            problem = labels.key_problem(key) or labels.value_problem(value)
            if problem:
                raise ValueError(f"label {key}={value}: {problem} ({labels.RULE})")
        return v

    @field_validator("taints", mode="before")
    @classmethod
    def _taints(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [Taint.parse(t) if isinstance(t, str) else t for t in v]
        return v

    @model_validator(mode="after")
    def _sizes(self) -> "NodePool":
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) > max_nodes ({self.max_nodes})")
        if self.initial_nodes is not None and not self.min_nodes <= self.initial_nodes <= self.max_nodes:
            raise ValueError(f"initial_nodes ({self.initial_nodes}) must lie in [min_nodes, max_nodes]")
        if self.eviction_rate_per_hour is not None and not self.spot and self.eviction_rate_per_hour > 0:
            raise ValueError("eviction_rate_per_hour applies to spot pools only (set spot: true)")
        if self.spot and self.pricing != "on_demand":  # the spot price would apply, and pricing be dropped unsaid
            raise ValueError(f"a spot pool pays the spot price, not {self.pricing} (drop pricing, or set spot: false)")
        return self

    @property
    def evictions_per_hour(self) -> float:
        if not self.spot:
            return 0.0
        return DEFAULT_EVICTION_RATE_PER_HOUR if self.eviction_rate_per_hour is None else self.eviction_rate_per_hour

    @property
    def start_nodes(self) -> int:
        return self.min_nodes if self.initial_nodes is None else self.initial_nodes


class Autoscaler(_Model):
    enabled: bool = True
    scale_up_delay: float = 300.0
    scale_down_unneeded_time: float = 600.0
    scale_down_delay_after_add: float = 600.0

    @field_validator("scale_up_delay", "scale_down_unneeded_time", "scale_down_delay_after_add", mode="before")
    @classmethod
    def _durations(cls, v: Any) -> Any:
        return 0.0 if v == 0 else _seconds(v)


class ClusterSpec(_Model):
    name: str = "cluster"
    autoscaler: Autoscaler = Field(default_factory=Autoscaler)
    pools: list[NodePool] = Field(min_length=1)
    #: restore-from-checkpoint time after a job is evicted or preempted (seconds)
    restart_overhead: float = 120.0
    #: how the autoscaler picks among pools that fit a pending job: the cheapest per GPU-hour, or in file order
    expander: Literal["least-cost", "priority"] = "least-cost"

    @field_validator("restart_overhead", mode="before")
    @classmethod
    def _restart(cls, v: Any) -> Any:
        return 0.0 if v == 0 else _seconds(v)

    @model_validator(mode="after")
    def _unique(self) -> "ClusterSpec":
        names = [p.name for p in self.pools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"pool name {dup[0]!r} appears twice")
        return self


_MODELS: dict[str, type[BaseModel]] = {"": ClusterSpec, "autoscaler": Autoscaler, "pools": NodePool}


def _cluster_error(exc: ValidationError, data: Any, src: _Source) -> SpecError:
    err = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")[0]
    path, value, found = _data_path(data, tuple(err["loc"]), err["type"])
    if err["type"] == "extra_forbidden":
        parent = next((k for k in path if isinstance(k, str) and k in _MODELS), "") if len(path) > 1 else ""
        known = list(_MODELS[parent].model_fields)
        close = difflib.get_close_matches(str(path[-1]), known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return src.error(f"unknown field '{path[-1]}'", path, None, fix=f"{hint}use one of: {', '.join(known)}")
    if err["type"] == "string_pattern_mismatch" and path and path[0] == "pools" and path[-1] == "name":
        # the job spec's wording ("not a valid job name", '_' allowed) is wrong for a pool
        return src.error(f"{value!r} is not a valid pool name", path, value if found else None,
                         fix="use 1-12 lowercase letters and digits, starting with a letter (AKS's rule for a node "
                             "pool name), e.g. gpupool")
    message, fix = _describe(err, path, value if found else None, data)
    if fix.startswith("correct ") and "README" in fix:
        fix = f"correct {dotted(path) or 'the cluster spec'} (see the cluster spec format in README.md)"
    return src.error(message, path, value if found else None, fix)


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster spec; SKU names are checked against the catalog by the caller."""
    shown = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise SpecError("cluster spec not found", file=shown, fix="pass a YAML file with `pools:`, e.g. examples/cluster/cluster.yaml") from None
    except IsADirectoryError:
        raise SpecError("is a directory, not a cluster spec file", file=shown,
                        fix="pass a YAML file with `pools:`, e.g. examples/cluster/cluster.yaml") from None
    except (PermissionError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read the cluster spec ({exc.__class__.__name__})", file=shown,
                        fix="pass a readable YAML file with `pools:`") from None
    data, node = parse(text, shown)
    if not isinstance(data, dict):
        raise SpecError("a cluster spec must be a YAML mapping", file=shown, line=1, fix="start with `pools:`")
    src = _Source(shown, line_map(node), {})
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as exc:
        raise _cluster_error(exc, data, src) from None


def pool_line(spec_file: str | Path, index: int) -> int | None:
    """The line of ``pools[index]`` in the spec file (for errors found after validation, e.g. an unknown SKU)."""
    try:
        node = yaml.compose(Path(spec_file).read_text(), Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return None
    return line_map(node).get(("pools", index, "sku"))
