"""GPU (seed 001 §2.5) and training alert rules through promtool: ``check rules`` accepts them and
``test rules`` shows each fires on the series it is written for and stays quiet on the others."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from azulite.observe.alerts import gpu_rule_groups, training_rule_groups
from azulite.observe.rules import rule_file

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) not installed")

GPU0 = {"gpu": "0", "UUID": "GPU-a", "modelName": "NVIDIA A100-SXM4-80GB", "Hostname": "n1"}
GPU1 = {**GPU0, "gpu": "1", "UUID": "GPU-b"}


def series(name: str, labels: dict, values: str) -> dict:
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


TESTS = {
    "rule_files": ["rules.yml"],
    "evaluation_interval": "1m",
    "tests": [
        {   # GPU 0 runs out of memory at 6 min (fires 2 min later); GPU 1 runs hot
            "interval": "1m",
            "input_series": [
                series("DCGM_FI_DEV_FB_FREE", GPU0, "2000x5 500x10"),
                series("DCGM_FI_DEV_FB_FREE", GPU1, "40000x15"),
                series("DCGM_FI_DEV_GPU_TEMP", GPU0, "70x15"),
                series("DCGM_FI_DEV_GPU_TEMP", GPU1, "90x15"),
            ],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "GPUMemoryExhausted", "exp_alerts": []},
                {"eval_time": "10m", "alertname": "GPUMemoryExhausted", "exp_alerts": [
                    {"exp_labels": {"severity": "critical", **GPU0},
                     "exp_annotations": {"summary": "GPU 0 memory exhausted",
                                         "description": "Only 500MB free GPU memory"}}]},
                {"eval_time": "10m", "alertname": "GPUTemperatureHigh", "exp_alerts": [
                    {"exp_labels": {"severity": "warning", **GPU1},
                     "exp_annotations": {"summary": "GPU 1 on n1 runs hot",
                                         "description": "90 C for 5 minutes (over 85 C): clocks will be throttled"}}]},
            ],
        },
        {   # "stuck" stopped logging and checkpointing at t=0; "moving" keeps doing both; "done" ended
            "interval": "1m",
            "input_series": [
                series("azulite_job_state", {"job_id": "stuck", "name": "t", "state": "running"}, "1x40"),
                series("azulite_job_state", {"job_id": "moving", "name": "t", "state": "running"}, "1x40"),
                series("azulite_job_state", {"job_id": "done", "name": "t", "state": "succeeded"}, "1x40"),
                series("azulite_job_last_progress_timestamp_seconds", {"job_id": "stuck"}, "0x40"),
                series("azulite_job_last_progress_timestamp_seconds", {"job_id": "moving"}, "0+60x40"),
                series("azulite_job_last_progress_timestamp_seconds", {"job_id": "done"}, "0x40"),
                series("azulite_job_checkpoint_last_timestamp_seconds", {"job_id": "stuck"}, "0x40"),
                series("azulite_job_checkpoint_interval_seconds", {"job_id": "stuck"}, "300x40"),
                series("azulite_job_checkpoint_last_timestamp_seconds", {"job_id": "moving"}, "0+60x40"),
                series("azulite_job_checkpoint_interval_seconds", {"job_id": "moving"}, "300x40"),
                series("azulite_job_rank_restarts_total", {"job_id": "stuck", "rank": "1"}, "0+1x10 10x30"),
                series("azulite_job_rank_restarts_total", {"job_id": "stuck", "rank": "0"}, "0x40"),
                series("azulite_job_state", {"job_id": "nan", "name": "t", "state": "running"}, "1x40"),
                series("azulite_job_state", {"job_id": "inf", "name": "t", "state": "running"}, "1x40"),
                series("azulite_job_train_loss", {"job_id": "nan"}, "0.5 0.5 0.5 NaN NaN NaN NaN NaN NaN"),
                series("azulite_job_train_loss", {"job_id": "inf"}, "0.5 0.5 0.5 Inf Inf Inf Inf Inf Inf"),
                series("azulite_job_train_loss", {"job_id": "moving"}, "0.3x40"),
            ],
            "alert_rule_test": [
                {"eval_time": "12m", "alertname": "AzuliteTrainingNoProgress", "exp_alerts": []},
                {"eval_time": "20m", "alertname": "AzuliteTrainingNoProgress", "exp_alerts": [
                    {"exp_labels": {"severity": "warning", "job_id": "stuck"},
                     "exp_annotations": {
                         "summary": "Job stuck has made no progress for 15 minutes",
                         "description": "No rank of the running attempt has written to its log: a hang "
                                        "(a collective waiting on a lost rank, a stuck data loader)?"}}]},
                {"eval_time": "12m", "alertname": "AzuliteCheckpointStale", "exp_alerts": []},
                {"eval_time": "20m", "alertname": "AzuliteCheckpointStale", "exp_alerts": [
                    {"exp_labels": {"severity": "warning", "job_id": "stuck"},
                     "exp_annotations": {
                         "summary": "Job stuck's last checkpoint is older than 3 checkpoint intervals",
                         "description": "A preemption now would lose that much work; check the checkpoint "
                                        "storage (azulite doctor --checkpoint ...)."}}]},
                {"eval_time": "2m", "alertname": "AzuliteTrainingLossNotFinite", "exp_alerts": []},
                {"eval_time": "5m", "alertname": "AzuliteTrainingLossNotFinite", "exp_alerts": [
                    {"exp_labels": {"severity": "critical", "job_id": job},
                     "exp_annotations": {
                         "summary": f"Job {job} logs a loss that is NaN or infinite",
                         "description": "Training diverged: stop it and resume from the last checkpoint "
                                        "with a lower learning rate, or check the input data."}}
                    for job in ("inf", "nan")]},
                {"eval_time": "10m", "alertname": "AzuliteRankRestarting", "exp_alerts": [
                    {"exp_labels": {"severity": "warning", "job_id": "stuck", "rank": "1"},
                     "exp_annotations": {
                         "summary": "Rank 1 of job stuck restarted over 3 times in 30m",
                         "description": "A crash loop: read the rank's log (azulite job logs ID --rank R)."}}]},
            ],
        },
    ],
}


def run_promtool(tmp_path, groups) -> subprocess.CompletedProcess:
    (tmp_path / "rules.yml").write_text(rule_file(groups))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(TESTS, sort_keys=False))
    return subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_gpu_and_training_rules_check_and_pass_their_unit_tests(tmp_path):
    groups = gpu_rule_groups() + training_rule_groups()
    (tmp_path / "rules.yml").write_text(rule_file(groups))
    check = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    run = run_promtool(tmp_path, groups)
    assert run.returncode == 0, run.stdout + run.stderr


def test_unit_tests_can_fail(tmp_path):
    """A no-progress window longer than the stall makes the expectation fail: the tests test."""
    run = run_promtool(tmp_path, gpu_rule_groups() + training_rule_groups(no_progress_minutes=30))
    assert run.returncode != 0 and "AzuliteTrainingNoProgress" in run.stdout + run.stderr
