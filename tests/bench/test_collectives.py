"""``azulite bench collectives``: nccl-tests' arithmetic, bad input, and one real sweep through the local
backend on 2 simulated nodes (gloo on loopback), its result read from the job store's job."""

from __future__ import annotations

import json
import math

import pytest

from azulite.bench.collectives import OPS, bus_factor, element_count, size_sweep, table
from azulite.bench.jobs import collectives_job
from azulite.cli.bench import parse_size
from azulite.errors import BenchInputError
from azulite.launch.backend import get_backend
from azulite.launch.records import JobState
from azulite.launch.settings import Settings
from tests.cli.test_job_cli import az
from tests.launch.jobkit import home

_ = home


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    for op in ("all_gather", "reduce_scatter", "alltoall"):
        assert bus_factor(op, 4) == pytest.approx(0.75)
    assert bus_factor("broadcast", 4) == 1.0
    assert bus_factor("all_reduce", 2) == 1.0
    with pytest.raises(ValueError):
        bus_factor("gather", 2)


def test_size_sweep_and_counts():
    assert size_sweep(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    assert size_sweep(1000, 1000, 2) == [1000]
    assert element_count("all_reduce", 1024, 3) == 256
    assert element_count("all_gather", 1024, 3) == 255  # whole chunks per rank
    assert element_count("alltoall", 1024, 4) == 256


def test_parse_size():
    assert parse_size("64M", "-e") == 64 << 20
    assert parse_size("1k", "-b") == 1024
    assert parse_size("4096", "-b") == 4096
    with pytest.raises(BenchInputError, match="-e"):
        parse_size("lots", "-e")


@pytest.mark.parametrize("kw, where", [
    ({"ops": ["all_reduce", "gather"]}, "--ops"),
    ({"min_bytes": 2048, "max_bytes": 1024}, "--min-bytes"),
    ({"factor": 1}, "--factor"),
    ({"nodes": 1, "procs_per_node": 1}, "--nodes"),
    ({"iters": 0}, "--iters"),
    ({"timeout_s": 0}, "--timeout"),
])
def test_bad_arguments_are_refused_before_anything_runs(kw, where, tmp_path):
    args = dict(nodes=2, procs_per_node=1, ops=["all_reduce"], min_bytes=1024, max_bytes=4096, factor=2,
                iters=1, warmup=0, code=str(tmp_path))
    with pytest.raises(BenchInputError) as e:
        collectives_job(**{**args, **kw})
    assert e.value.where.startswith(where)
    assert e.value.fix


def test_cli_bad_size_is_a_message_not_a_traceback(home):
    p = az("bench", "collectives", "--max-bytes", "huge")
    assert p.returncode == 2
    assert "--max-bytes" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("sku, words", [
    ("Bogus_SKU", "error: --instance-type: unknown SKU 'Bogus_SKU' fix: list the known SKUs with `azulite catalog`"),
    ("ND96asr_v5", "unknown SKU 'ND96asr_v5' fix: did you mean Standard_ND96asr_v4"),
])
def test_cli_unknown_instance_type_is_refused_before_anything_runs(capsys, monkeypatch, tmp_path, sku, words):
    # it was recorded with the job as given
    from tests.cli.inprocess import exit_code as run

    monkeypatch.setenv("AZULITE_HOME", str(tmp_path / "home"))
    assert run("bench", "collectives", "--instance-type", sku) == 2
    assert words in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "home" / "jobs").exists()


def test_cli_instance_type_is_recorded_by_its_catalog_name(tmp_path):
    from azulite.cli.bench import _known_sku

    assert _known_sku("nc24rs_v3") == "Standard_NC24rs_v3"
    mine = tmp_path / "mine.toml"
    mine.write_text('[[sku]]\nname = "Standard_NC8as_T4_v3"\ncloud = "azure"\ngpus = 1\ngpu_type = "T4"\n'
                    'gpu_memory_gb = 16\nvcpus = 8\nram_gb = 56\n')
    assert _known_sku("NC8as_T4_v3", mine) == "Standard_NC8as_T4_v3"


def test_table_layout():
    rows = [{"op": "all_reduce", "size": 1024, "count": 256, "time_us": 10.0, "algbw": 0.1024, "busbw": 0.1024,
             "wrong": 0, "redop": "sum", "root": -1}]
    text = table(rows, world_size=2, backend="gloo", memcopy_gbps=9.5)
    assert "# Collective test: all_reduce" in text
    assert "memory-copy bandwidth (local limit): 9.50 GB/s" in text
    assert "(GB/s)" in text and "#wrong" in text
    assert "Avg bus bandwidth    : 0.102" in text


@pytest.mark.slow
def test_sweep_on_two_simulated_nodes(home):
    p = az("bench", "collectives", "--nodes", "2", "--procs-per-node", "1", "-b", "1K", "-e", "8K", "-f", "8",
           "--iters", "2", "--warmup", "1", "--json", timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(p.stdout)
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    rows = result["rows"]
    assert [(r["op"], r["size"]) for r in rows] == [(op, s) for op in OPS for s in (1024, 8192)]
    for r in rows:
        assert r["wrong"] == 0, r
        assert r["time_us"] > 0
        assert r["algbw"] == pytest.approx(r["size"] / 1e9 / (r["time_us"] / 1e6))
        assert r["busbw"] == pytest.approx(r["algbw"] * bus_factor(r["op"], 2))
    assert math.isfinite(result["memcopy_gbps"]) and result["memcopy_gbps"] > 0
    # it ran as an ordinary job of the store, on 2 nodes
    rec = get_backend("local", Settings.from_environ()).status(result["job_id"])
    assert rec.state == JobState.SUCCEEDED
    assert {p.node for p in rec.processes if p.kind == "rank"} == {0, 1}
    # the people's form of the same run
    p = az("bench", "collectives", "--nodes", "2", "--procs-per-node", "1", "--ops", "broadcast", "-b", "4K",
           "-e", "4K", "--iters", "1", "--warmup", "0", timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# Collective test: broadcast" in p.stdout and "Out of bounds values : 0 OK" in p.stdout
