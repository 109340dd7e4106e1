"""Traces: azulite's CSV with errors naming the line and column, and the importers run on excerpts of the
real public traces shipped in tests/cluster/data (sources in SOURCES.md)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from azulite.cluster.trace import read_csv, read_pai2020, read_pai2023, read_philly, read_trace, write_csv
from azulite.errors import TraceError

DATA = Path(__file__).parent / "data"


def _csv(tmp_path, text: str) -> Path:
    f = tmp_path / "trace.csv"
    f.write_text(text)
    return f


def test_csv_reads_every_column(tmp_path):
    t = read_csv(_csv(tmp_path, "# comment\njob_id,submit_time,gpus,duration,priority,node_selector,tolerations,checkpoint_interval\n"
                      "a,0,8,2h,0,,,\nb,0,4,90m,10,agentpool=gpunp,k=v:NoSchedule,1800\nc,5,1,30,,,,\n"))
    assert t.ids == ["a", "b", "c"]
    assert t.duration.tolist() == [7200, 5400, 30] and t.gpus.tolist() == [8, 4, 1]
    assert t.priority.tolist() == [0, 10, 0]
    assert math.isinf(t.checkpoint_interval[0]) and t.checkpoint_interval[1] == 1800
    assert t.selectors[t.selector[1]] == (("agentpool", "gpunp"),) and t.tolerations[t.toleration[1]] == ("k=v:NoSchedule",)
    out = tmp_path / "again.csv"
    write_csv(t, out)
    again = read_csv(out)
    assert again.ids == t.ids and np.array_equal(again.duration, t.duration)


@pytest.mark.parametrize(
    "text, where, words",
    [
        ("job_id,submit_time,duration\na,0,10\n", ":1", "missing column(s) gpus"),
        ("job_id,submit_time,gpus,duration,colour\na,0,1,10,red\n", ":1", "unknown column 'colour'"),
        ("job_id,submit_time,gpus,duration\na,0,1,10\nb,5,1,0\n", ":3", "'duration' must be > 0"),
        ("job_id,submit_time,gpus,duration\na,0,1,-5\n", ":2", "'duration' must be > 0"),
        ("job_id,submit_time,gpus,duration\na,10,1,5\nb,3,1,5\n", ":3", "not sorted"),
        ("job_id,submit_time,gpus,duration\na,0,1,5\na,3,1,5\n", ":3", "duplicate job_id 'a' (first at line 2)"),
        ("job_id,submit_time,gpus,duration\na,0,0,5\n", ":2", "'gpus' must be >= 1"),
        ("job_id,submit_time,gpus,duration\na,0,two,5\n", ":2", "'gpus' must be a whole number"),
        ("job_id,submit_time,gpus,duration\na,x,1,5\n", ":2", "'submit_time' must be seconds"),
        ("job_id,submit_time,gpus,duration\n", "trace.csv", "no jobs"),
        # was "must be >= 0" for a time past float's range
        ("job_id,submit_time,gpus,duration\na,1e400,1,5\n", ":2", "'submit_time' must be a finite number of seconds"),
    ],
)
def test_csv_errors_name_line_and_column(tmp_path, text, where, words):
    with pytest.raises(TraceError) as e:
        read_csv(_csv(tmp_path, text))
    assert where in str(e.value) and words in str(e.value)


def test_csv_errors_name_the_file_line_past_comments(tmp_path):
    # "row 2" counted rows without the comment lines: the example trace's first job is on line 3
    with pytest.raises(TraceError) as e:
        read_csv(_csv(tmp_path, "# jobs\n\njob_id,submit_time,gpus,duration\na,0,1,10\n# b next\nb,5,1,0\n"))
    assert str(e.value).startswith(f"{tmp_path / 'trace.csv'}:6: column 'duration' must be > 0")


@pytest.mark.parametrize("toleration", ["k", "k=v", "k=", "k:NoExecute", "k=v:PreferNoSchedule", "sku=gpu:NoSchedule",
                                        "kubernetes.azure.com/scalesetpriority=spot:NoSchedule"])
def test_csv_takes_kubernetes_tolerations(tmp_path, toleration):
    t = read_csv(_csv(tmp_path, f"job_id,submit_time,gpus,duration,tolerations\na,0,1,10,{toleration};x:NoSchedule\n"))
    assert t.tolerations[t.toleration[0]] == tuple(sorted((toleration, "x:NoSchedule")))


@pytest.mark.parametrize("toleration, words", [
    # the misspelt effect tolerated no taint: the job silently ran on other pools, at another cost
    ("spot:NoSchedul", "'spot:NoSchedul': effect 'NoSchedul' is not one of NoSchedule, PreferNoSchedule, NoExecute "
                       "(did you mean NoSchedule?)"),
    ("k=v:Bogus", "effect 'Bogus' is not one of"),
    ("k:", "an empty effect after ':' is not one of"),
    ("=v:NoSchedule", "key '' is not a Kubernetes label key"),
    ("a/b/c=v", "key 'a/b/c' is not a Kubernetes label key"),
    ("k=v w", "value 'v w' is not a Kubernetes label value"),
])
def test_csv_tolerations_are_checked(tmp_path, toleration, words):
    with pytest.raises(TraceError) as e:
        read_csv(_csv(tmp_path, f"# one job\njob_id,submit_time,gpus,duration,tolerations\na,0,1,10,x:NoSchedule;{toleration}\n"))
    assert str(e.value).startswith(f"{tmp_path / 'trace.csv'}:3: column 'tolerations': ") and words in str(e.value)
    assert "key=value:Effect (operator Equal), key:Effect (Exists: any value)" in e.value.fix


def test_philly_cluster_job_log_excerpt():
    t = read_philly(DATA / "philly_cluster_job_log.readme_example.json")
    assert t.ids == ["application_1506638472019_14199"]
    assert t.gpus.tolist() == [8]
    # two attempts: 01:12:09-01:13:23 (74 s) and 2017-10-07 01:13:30 - 2017-10-09 06:53:12
    assert t.duration[0] == 74 + (2 * 86400 + 5 * 3600 + 39 * 60 + 42)
    assert t.submit[0] == 0.0


def test_philly_skips_unusable_jobs(tmp_path):
    f = tmp_path / "log.json"
    f.write_text('[{"status": "Pass", "jobid": "a", "submitted_time": "2017-10-01 00:00:00", "attempts": [{"start_time": "2017-10-01 00:01:00", "end_time": "2017-10-01 01:01:00", "detail": [{"ip": "m1", "gpus": ["gpu0", "gpu1"]}, {"ip": "m2", "gpus": ["gpu0", "gpu1"]}]}]},'
                 ' {"status": "Killed", "jobid": "b", "submitted_time": "2017-10-01 00:00:05", "attempts": []},'
                 ' {"status": "Running", "jobid": "c", "submitted_time": "2017-10-01 00:00:09", "attempts": [{"start_time": "2017-10-01 00:02:00", "end_time": null, "detail": []}]}]')
    t = read_philly(f)
    assert t.ids == ["a"] and t.gpus.tolist() == [4] and t.duration.tolist() == [3600]
    assert t.skipped == {"no attempts": 1, "still running or no end_time": 1}


def test_pai2020_task_and_job_table_excerpt():
    t = read_pai2020(DATA / "pai_task_table.readme_example.csv", DATA / "pai_job_table.readme_example.csv")
    assert t.ids == ["4f057009a5d481acec67b088"]
    assert t.gpus.tolist() == [1]           # plan_gpu 50 (%): half a GPU rounds up to one
    assert t.duration.tolist() == [38.0]    # 1739200 - 1739162
    assert t.skipped == {"job without tasks": 1}


def test_pai2020_wrong_column_count_names_the_row(tmp_path):
    f = tmp_path / "pai_task_table.csv"
    f.write_text("j1,worker,1.0,Terminated,10,20,600,29,100,V100\nj2,worker,1.0,Terminated,10\n")
    with pytest.raises(TraceError, match=r"row 2.*5 columns, expected 10"):
        read_pai2020(f)


def test_pai2023_pod_list_excerpt():
    t = read_trace(DATA / "openb_pod_list_default.head40.csv", "pai2023")
    assert len(t) == 38                     # 40 rows + 2 Pending: 2 CPU-only and the 2 Pending skipped
    assert t.skipped == {"CPU-only pod": 2, "never scheduled": 2}
    i = t.ids.index("openb-pod-0017")
    assert t.gpus[i] == 8 and t.duration[i] == 10769854 - 9437497
    assert t.submit[0] == 0 and np.all(np.diff(t.submit) >= 0)


def test_pai2023_missing_column(tmp_path):
    f = tmp_path / "pods.csv"
    f.write_text("name,num_gpu,creation_time\np,1,0\n")
    with pytest.raises(TraceError, match="missing column"):
        read_pai2023(f)


@pytest.mark.parametrize("fmt", ["csv", "philly", "pai2020", "pai2023"])
def test_every_format_refuses_a_directory_and_a_binary_file(tmp_path, fmt):
    # philly, pai2020 and pai2023 let IsADirectoryError / UnicodeDecodeError out as tracebacks
    with pytest.raises(TraceError) as e:
        read_trace(tmp_path, fmt)
    assert "the trace is a directory" in str(e.value)
    binary = tmp_path / "trace.gz"
    binary.write_bytes(b"\x1f\x8b\x08\x00\xff\xfe" * 8)
    with pytest.raises(TraceError) as e:
        read_trace(binary, fmt, job_table=DATA / "pai_job_table.readme_example.csv" if fmt == "pai2020" else None)
    assert "not a UTF-8 text file" in str(e.value) and fmt in str(e.value)


def test_pai2020_job_table_that_is_a_directory(tmp_path):
    with pytest.raises(TraceError) as e:
        read_trace(DATA / "pai_task_table.readme_example.csv", "pai2020", job_table=tmp_path)
    assert "--job-table is a directory" in str(e.value)


def test_job_table_with_another_format_is_an_error(tmp_path):
    with pytest.raises(TraceError) as e:  # it was silently ignored
        read_trace(_csv(tmp_path, "job_id,submit_time,gpus,duration\na,0,1,10\n"), "csv", job_table=tmp_path / "typo.csv")
    assert "only read with --format pai2020" in str(e.value)
