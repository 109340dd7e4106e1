"""The serving latency and availability rules (``latency_rule_groups``) through promtool: p99 from the
request-latency histogram over its target, and a model whose series vanished."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from azulite.observe.rules import rule_file
from azulite.serve.alerts import latency_rule_groups

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) not installed")

H = "nv_inference_first_response_histogram_ms_bucket"
TESTS = {
    "rule_files": ["rules.yml"],
    "evaluation_interval": "1m",
    "tests": [{
        # "slow" answers everything between 200 and 600 ms (p99 = 200 + 400 * 0.99 = 596), "fast" under 200;
        # "gone" is served for 10 minutes and then unloaded
        "interval": "1m",
        "input_series": [
            {"series": f'{H}{{model="slow",version="1",le="200.0"}}', "values": "0x40"},
            {"series": f'{H}{{model="slow",version="1",le="600.0"}}', "values": "0+10x40"},
            {"series": f'{H}{{model="slow",version="1",le="+Inf"}}', "values": "0+10x40"},
            {"series": f'{H}{{model="fast",version="1",le="200.0"}}', "values": "0+10x40"},
            {"series": f'{H}{{model="fast",version="1",le="600.0"}}', "values": "0+10x40"},
            {"series": f'{H}{{model="fast",version="1",le="+Inf"}}', "values": "0+10x40"},
            {"series": 'nv_inference_request_success{model="kept",version="1"}', "values": "0+5x40"},
            {"series": 'nv_inference_request_success{model="gone",version="1"}', "values": "0+5x10 _x30"},
        ],
        "promql_expr_test": [
            {"expr": 'model:nv_inference_first_response_ms:p99{model="slow"}', "eval_time": "20m",
             "exp_samples": [{"labels": 'model:nv_inference_first_response_ms:p99{model="slow"}', "value": 596}]},
        ],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "AzuliteLatencyP99High", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "AzuliteLatencyP99High", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "model": "slow"},
                 "exp_annotations": {"summary": "Model slow p99 latency 596 ms is over its 300 ms target"}}]},
            {"eval_time": "5m", "alertname": "AzuliteModelUnavailable", "exp_alerts": []},
            {"eval_time": "30m", "alertname": "AzuliteModelUnavailable", "exp_alerts": [
                {"exp_labels": {"severity": "critical", "model": "gone"},
                 "exp_annotations": {"summary": "Model gone is no longer served",
                                     "description": "It was served in the last hour and its metrics are gone: "
                                                    "unloaded, failed to load, or its server is down."}}]},
        ],
    }],
}


def run_promtool(tmp_path, groups) -> subprocess.CompletedProcess:
    (tmp_path / "rules.yml").write_text(rule_file(groups))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(TESTS, sort_keys=False))
    return subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_latency_rules_check_and_pass_their_unit_tests(tmp_path):
    groups = latency_rule_groups(p99_target_ms=300)
    (tmp_path / "rules.yml").write_text(rule_file(groups))
    check = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    run = run_promtool(tmp_path, groups)
    assert run.returncode == 0, run.stdout + run.stderr


def test_unit_tests_can_fail(tmp_path):
    run = run_promtool(tmp_path, latency_rule_groups(p99_target_ms=1000))
    assert run.returncode != 0 and "AzuliteLatencyP99High" in run.stdout + run.stderr
