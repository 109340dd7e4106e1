"""The serving alert rules through promtool: they check, and unit tests (``promtool test rules``) show
each fires on the series it is written for and stays quiet otherwise."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from azulite.observe.rules import rule_file
from azulite.serve.alerts import serving_rule_groups

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) not installed")

TESTS = {
    "rule_files": ["rules.yml"],
    "evaluation_interval": "1m",
    "tests": [
        {   # drift: a PSI over 0.25 for 15 minutes fires; a small one never does
            "interval": "1m",
            "input_series": [
                {"series": 'azulite_output_psi{model="m",output="y"}', "values": "0.05x10 0.4x30"},
                {"series": 'azulite_output_psi{model="quiet",output="y"}', "values": "0.05x40"},
                {"series": 'azulite_output_ks{model="m",output="y"}', "values": "0.1x40"},
            ],
            "alert_rule_test": [
                {"eval_time": "20m", "alertname": "AzuliteOutputDriftPSI", "exp_alerts": []},
                {"eval_time": "30m", "alertname": "AzuliteOutputDriftPSI", "exp_alerts": [
                    {"exp_labels": {"severity": "warning", "model": "m", "output": "y"},
                     "exp_annotations": {
                         "summary": "Output y of model m drifted (PSI)",
                         "description": "PSI 0.400 of the current window against the reference window is over "
                                        "0.25 for 15m: the model's inputs or behaviour changed."}}]},
                {"eval_time": "30m", "alertname": "AzuliteOutputDriftKS", "exp_alerts": []},
            ],
        },
        {   # errors over 5% of requests for 10 minutes; lost audit lines at once
            "interval": "1m",
            "input_series": [
                {"series": 'nv_inference_request_failure{model="m",version="1",reason="BACKEND"}', "values": "0+10x40"},
                {"series": 'nv_inference_request_success{model="m",version="1"}', "values": "0+90x40"},
                {"series": 'nv_inference_request_failure{model="ok",version="1",reason="BACKEND"}', "values": "0x40"},
                {"series": 'nv_inference_request_success{model="ok",version="1"}', "values": "0+90x40"},
                {"series": "azulite_audit_write_errors_total", "values": "0x10 1x30"},
                {"series": "azulite_audit_dropped_total", "values": "0x40"},
            ],
            "alert_rule_test": [
                {"eval_time": "30m", "alertname": "AzuliteInferenceErrors", "exp_alerts": [
                    {"exp_labels": {"severity": "critical", "model": "m"},
                     "exp_annotations": {"summary": "Model m fails over 5% of its requests"}}]},
                {"eval_time": "5m", "alertname": "AzuliteAuditLogLosing", "exp_alerts": []},
                {"eval_time": "12m", "alertname": "AzuliteAuditLogLosing", "exp_alerts": [
                    {"exp_labels": {"severity": "critical"},
                     "exp_annotations": {"summary": "Audit log lines are being lost (disk full or unwritable?)"}}]},
            ],
        },
    ],
}


def test_serving_rules_check_and_pass_their_unit_tests(tmp_path):
    (tmp_path / "rules.yml").write_text(rule_file(serving_rule_groups()))
    check = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(TESTS, sort_keys=False))
    run = subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_unit_tests_can_fail(tmp_path):
    """A threshold that would not fire at 0.4 makes the drift expectation fail: the tests test."""
    (tmp_path / "rules.yml").write_text(rule_file(serving_rule_groups(psi_threshold=0.5)))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(TESTS, sort_keys=False))
    run = subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "AzuliteOutputDriftPSI" in run.stdout + run.stderr
