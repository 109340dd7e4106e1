"""Which of a run's files ``job logs`` prints (the end-to-end path is in test_azureml.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("azure.ai.ml")

from azulite.launch.azureml_logs import log_names  # noqa: E402

FILES = {n: "url" for n in ("user_logs/std_log_process_0.txt", "user_logs/std_log_process_1.txt",
                            "user_logs/std_log_process_10.txt", "system_logs/lifecycler/execution-wrapper.txt",
                            "azureml-logs/70_driver_log.txt")}


def test_user_logs_of_every_rank_sorted_and_system_logs_left_out():
    assert log_names(FILES, None) == ["user_logs/std_log_process_0.txt", "user_logs/std_log_process_1.txt",
                                      "user_logs/std_log_process_10.txt"]


@pytest.mark.parametrize("rank, expected", [(0, ["user_logs/std_log_process_0.txt"]), (1, ["user_logs/std_log_process_1.txt"]),
                                            (10, ["user_logs/std_log_process_10.txt"]), (2, [])])
def test_one_rank(rank, expected):
    assert log_names(FILES, rank) == expected


def test_single_process_log_is_rank_0_and_legacy_logs_when_no_user_logs():
    assert log_names({"user_logs/std_log.txt": "u"}, 0) == ["user_logs/std_log.txt"]
    legacy = {"azureml-logs/70_driver_log.txt": "u", "azureml-logs/55_azureml-execution.txt": "u", "logs/x.txt": "u"}
    assert log_names(legacy, None) == ["azureml-logs/55_azureml-execution.txt", "azureml-logs/70_driver_log.txt"]
