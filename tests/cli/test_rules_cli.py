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
    assert obj["metadata"]["labels"] == {}
    # kube-prometheus-stack's default ruleSelector loads only rules labelled release=<its Helm release>
    obj = yaml.safe_load(az("rules", "render", "--parts", "gpu", "--format", "prometheusrule", "--rule-label",
                            "release=kube-prometheus-stack", "--rule-label", "team=ml", check=0).stdout)
    assert obj["metadata"]["labels"] == {"release": "kube-prometheus-stack", "team": "ml"}


@pytest.mark.parametrize("args, where", [
    (["--parts", "gpu,disks"], "--parts"), (["--format", "json"], "--format"), (["--checkpoint-k", "0"], "--checkpoint-k"),
    # an alert that fires for half of every checkpoint interval, and one that fires at every interval's end
    (["--checkpoint-k", "0.5"], "--checkpoint-k: must be > 1, got 0.5"), (["--checkpoint-k", "1"], "--checkpoint-k: must be > 1, got 1"),
    # each rendered a file promtool accepts: an alert that can never fire, a rule file with no rules
    (["--p99-target-ms", "nan"], "--p99-target-ms"), (["--parts", ","], "--parts: no rule part given"),
    (["--format", "prometheusrule", "--namespace", "Bad_NS!"], "--namespace: namespace 'Bad_NS!' is not"),
    (["--namespace", "ops"], "--name, --namespace and --rule-label are the PrometheusRule object's"),  # ignored by --format file
    (["--rule-label", "release=kps"], "--name, --namespace and --rule-label are the PrometheusRule object's"),
    (["--format", "prometheusrule", "--rule-label", "release"], "--rule-label: 'release': no '=' in it"),
])
def test_bad_flags_are_named(args, where):
    p = az("rules", "render", *args)
    assert p.returncode == 2 and where in p.stderr and "Traceback" not in p.stderr and p.stdout == ""


def test_parts_ignore_case_like_the_other_filters():
    assert az("rules", "render", "--parts", "GPU", check=0).stdout == az("rules", "render", "--parts", "gpu", check=0).stdout


def test_out_that_is_a_directory_or_in_a_missing_folder_is_named_and_leaves_nothing(tmp_path, capsys):
    from azulite.cli import main

    def code(*args: str) -> int:
        try:
            main(["rules", "render", *args])
        except SystemExit as e:
            return e.code or 0
        return 0

    # both were tracebacks; the directory case also left a .NAME.xxxx temp file beside it
    assert code("-o", str(tmp_path)) == 2
    assert "is a directory" in capsys.readouterr().err
    assert code("-o", str(tmp_path / "nodir" / "rules.yml")) == 2
    assert "does not exist" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert code("-o", str(tmp_path / "rules.yml")) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["rules.yml"]
