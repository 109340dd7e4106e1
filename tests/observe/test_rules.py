"""The rule renderer: groups as data -> a rule file promtool accepts and a PrometheusRule object with
the same groups; mistakes named before anything is written."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from azulite.errors import SpecError
from azulite.observe.rules import Alert, Record, RuleGroup, prometheus_rule, prometheus_rule_yaml, rule_file

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) not installed")

GROUPS = [RuleGroup(name="demo", interval="30s", rules=(
    Record(record="job:up:sum", expr="sum by (job) (up)"),
    Alert(alert="DemoDown", expr="job:up:sum == 0", for_="5m", labels={"severity": "critical"},
          annotations={"summary": "{{ $labels.job }} is down"}),
    Alert(alert="DemoMultiLine", expr="sum(up)\n  < 1"),
))]


@needs_promtool
def test_rule_file_passes_promtool(tmp_path):
    path = tmp_path / "rules.yml"
    path.write_text(rule_file(GROUPS))
    check = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 3 rules found" in check.stdout


@needs_promtool
def test_promtool_rejects_what_we_would_not_catch(tmp_path):
    """The check can fail: a PromQL syntax error passes our validation but not promtool's."""
    path = tmp_path / "bad.yml"
    path.write_text(rule_file([RuleGroup(name="bad", rules=(Alert(alert="Bad", expr="sum(up"),))]))
    check = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode != 0


def test_prometheus_rule_object_holds_the_same_groups():
    obj = prometheus_rule(GROUPS, name="azulite-demo", namespace="monitoring", labels={"release": "prom"})
    assert obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["kind"] == "PrometheusRule"
    assert obj["spec"] == yaml.safe_load(rule_file(GROUPS))
    assert yaml.safe_load(prometheus_rule_yaml(GROUPS, name="azulite-demo")) == {
        **obj, "metadata": {"name": "azulite-demo", "namespace": "monitoring", "labels": {}}}
    rules = obj["spec"]["groups"][0]["rules"]
    assert rules[1]["for"] == "5m" and "for" not in rules[2]
    assert "\n" in rules[2]["expr"]


@pytest.mark.parametrize("groups, message", [
    ([RuleGroup(name="g", rules=(Alert(alert="bad name", expr="up"),))], "not a valid"),
    ([RuleGroup(name="g", rules=(Alert(alert="A", expr="up", for_="5 minutes"),))], "'for'"),
    ([RuleGroup(name="g", rules=(Alert(alert="A", expr="up"), Alert(alert="A", expr="up")))], "twice"),
    ([RuleGroup(name="g", rules=())], "no rules"),
    ([RuleGroup(name="g", rules=(Record(record="r", expr=" "),))], "empty expression"),
    ([RuleGroup(name="g", rules=(Record(record="r", expr="up"),)),
      RuleGroup(name="g", rules=(Record(record="r", expr="up"),))], "unique"),
    ([RuleGroup(name="g", rules=(Alert(alert="A", expr="up", labels={"bad-label": "x"}),))], "label name"),
])
def test_mistakes_are_named(groups, message):
    with pytest.raises(SpecError, match=message):
        rule_file(groups)


def test_object_name_is_checked():
    with pytest.raises(SpecError, match="Kubernetes object name"):
        prometheus_rule(GROUPS, name="Not_Valid")
