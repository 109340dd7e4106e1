"""``azulite rules render``: every part's rules in one file promtool accepts, the same groups as a
PrometheusRule, bad flags named."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.cli.test_job_cli import az

PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) not installed")
def test_render_all_parts_passes_promtool(tmp_path):
    out = tmp_path / "rules.yml"
    p = az("rules", "render", "-o", str(out), "--p99-target-ms", "250")
    assert p.returncode == 0, p.stderr
    check = subprocess.run([PROMTOOL, "check", "rules", str(out)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    doc = yaml.safe_load(out.read_text())
    names = {r.get("alert") for g in doc["groups"] for r in g["rules"]}
    assert {"GPUMemoryExhausted", "AzuliteTrainingNoProgress", "AzuliteCheckpointStale", "AzuliteRankRestarting",
            "AzuliteLatencyP99High", "AzuliteModelUnavailable", "AzuliteInferenceErrors", "AzuliteQueueBacklog"} <= names
    assert "> 250" in out.read_text()
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")], "no temp file left"


def test_prometheusrule_holds_the_same_groups():
    file_doc = yaml.safe_load(az("rules", "render", "--parts", "gpu,training", check=0).stdout)
    obj = yaml.safe_load(az("rules", "render", "--parts", "gpu,training", "--format", "prometheusrule",
                            "--name", "gpu-alerts", check=0).stdout)
    assert obj["kind"] == "PrometheusRule" and obj["metadata"]["name"] == "gpu-alerts"
    assert obj["metadata"]["namespace"] == "monitoring"
    assert obj["spec"]["groups"] == file_doc["groups"]
    assert [g["name"] for g in file_doc["groups"]] == ["gpu.rules", "azulite-training"]


@pytest.mark.parametrize("args, where", [(["--parts", "gpu,disks"], "--parts"), (["--format", "json"], "--format"),
                                         (["--checkpoint-k", "0"], "--checkpoint-k")])
def test_bad_flags_are_named(args, where):
    p = az("rules", "render", *args)
    assert p.returncode == 2 and where in p.stderr and "Traceback" not in p.stderr
