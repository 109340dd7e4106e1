"""The one alert-rule renderer: rule groups as data -> a Prometheus rule file (YAML) and a Kubernetes
``PrometheusRule`` object (prometheus-operator's ``monitoring.coreos.com/v1``), the same groups in both.

Every part that exports metrics describes its alerts as :class:`RuleGroup` data next to the metrics it
names (serving: ``azulite.serve.alerts``); nothing else writes rule YAML. The result is checked in tests
with ``promtool check rules`` and unit-tested with ``promtool test rules`` (Debian package ``prometheus``).
Validation here catches what promtool would refuse (bad names, durations, duplicate alerts in a group)
with an error that names the rule, before any file is written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import yaml

from azulite.errors import SpecError

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # RFC 1123 label: a namespace's name


@dataclass(frozen=True, slots=True, kw_only=True)
class Alert:
    """One alerting rule. ``for_`` is Prometheus' ``for`` (how long the condition must hold)."""

    alert: str
    expr: str
    for_: str = "0s"
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out: dict = {"alert": self.alert, "expr": self.expr}
        if self.for_ != "0s":
            out["for"] = self.for_
        if self.labels:
            out["labels"] = dict(self.labels)
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    """One recording rule."""

    record: str
    expr: str
    labels: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out: dict = {"record": self.record, "expr": self.expr}
        if self.labels:
            out["labels"] = dict(self.labels)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleGroup:
    name: str
    rules: tuple[Alert | Record, ...]
    interval: str | None = None

    def to_dict(self) -> dict:
        out: dict = {"name": self.name}
        if self.interval:
            out["interval"] = self.interval
        out["rules"] = [r.to_dict() for r in self.rules]
        return out


def is_duration(text: str) -> bool:
    """Whether ``text`` is a Prometheus duration (``5m``, ``1h30m``), as ``for`` and ``interval`` take."""
    return bool(_DURATION.match(text))


def validate(groups: Iterable[RuleGroup]) -> list[RuleGroup]:
    groups = list(groups)
    seen_groups: set[str] = set()
    for g in groups:
        where = f"rule group '{g.name}'"
        if not g.name or g.name in seen_groups:
            raise SpecError(f"{where}: group names must be present and unique", field="groups")
        seen_groups.add(g.name)
        if g.interval is not None and not _DURATION.match(g.interval):
            raise SpecError(f"{where}: interval {g.interval!r} is not a duration", field="interval", fix="e.g. 30s, 1m")
        if not g.rules:
            raise SpecError(f"{where} has no rules", field="rules")
        alerts: set[str] = set()
        for r in g.rules:
            name = r.alert if isinstance(r, Alert) else r.record
            rwhere = f"{where}, rule '{name}'"
            if not _NAME.match(name):
                raise SpecError(f"{rwhere}: not a valid metric/alert name", field="rules",
                                fix="letters, digits, '_' and ':' only, not starting with a digit")
            if not r.expr.strip():
                raise SpecError(f"{rwhere}: empty expression", field="expr")
            for key in r.labels:
                if not _LABEL.match(key):
                    raise SpecError(f"{rwhere}: label name {key!r} is not valid", field="labels")
            if isinstance(r, Alert):
                if not _DURATION.match(r.for_):
                    raise SpecError(f"{rwhere}: 'for' {r.for_!r} is not a duration", field="for", fix="e.g. 5m")
                if name in alerts:
                    raise SpecError(f"{rwhere}: the alert is defined twice in the group", field="rules")
                alerts.add(name)
                for key in r.annotations:
                    if not _LABEL.match(key):
                        raise SpecError(f"{rwhere}: annotation name {key!r} is not valid", field="annotations")
    return groups


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str):
    # multi-line expressions as literal blocks: the file stays readable and diffs line by line
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def rule_file(groups: Iterable[RuleGroup]) -> str:
    """A Prometheus rule file (``rule_files:``), as promtool checks it."""
    doc = {"groups": [g.to_dict() for g in validate(groups)]}
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120)


def prometheus_rule(groups: Iterable[RuleGroup], *, name: str, namespace: str = "monitoring",
                    labels: Mapping[str, str] | None = None) -> dict:
    """The same groups as a prometheus-operator ``PrometheusRule`` object (a dict; ``yaml.safe_dump`` it)."""
    if not _K8S_NAME.match(name) or len(name) > 253:
        raise SpecError(f"PrometheusRule name {name!r} is not a Kubernetes object name", field="name",
                        fix="lower-case letters, digits, '-' and '.', e.g. azulite-serving")
    if not _DNS_LABEL.match(namespace):
        raise SpecError(f"namespace {namespace!r} is not a Kubernetes namespace name", field="namespace",
                        fix="lower-case letters, digits and '-', at most 63, e.g. monitoring")
    from azulite.spec import labels as k8s_labels

    for key, value in (labels or {}).items():
        problem = k8s_labels.key_problem(key) or k8s_labels.value_problem(value)
        if problem:
            raise SpecError(f"PrometheusRule label {key}={value}: {problem}", field="labels", fix=k8s_labels.RULE)
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
            "spec": {"groups": [g.to_dict() for g in validate(groups)]}}


def prometheus_rule_yaml(groups: Iterable[RuleGroup], **kw) -> str:
    return yaml.dump(prometheus_rule(groups, **kw), Dumper=_Dumper, sort_keys=False, width=120)
