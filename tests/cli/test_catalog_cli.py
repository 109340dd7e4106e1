"""``azulite catalog``: the table, --gpu filter, --json with sources, and an unknown-catalog-file error
as a message with exit code 2."""

from __future__ import annotations

import json

import pytest

from tests.cli.inprocess import exit_code as run


def test_catalog_json_filters_and_carries_sources(capsys):
    assert run("catalog", "--gpu", "T4", "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["Standard_NC4as_T4_v3"]
    p = rows[0]["prices"]
    assert p["on_demand"]["usd_per_hour"] == 0.526 and p["on_demand"]["date"] == "2025-11-14"
    assert p["reserved_1y"] is None


def test_catalog_table_marks_unknown_and_derived(capsys):
    assert run("catalog", "--cloud", "azure", "--sources") == 0
    out = capsys.readouterr().out
    assert "NC24rs_v3" in out and "3.060" in out and "0.630*" in out and "ND96isr_H100_v5" in out
    assert "seed 001 §4.1" in out


def test_catalog_missing_file_is_an_error_not_a_traceback(capsys, tmp_path):
    assert run("catalog", "--catalog", str(tmp_path / "nope.toml")) == 2
    assert "catalog file not found" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, known", [("--gpu", "B200", "A100, H100, T4, V100"), ("--cloud", "oracle", "aws, azure, gcp")])
def test_catalog_unknown_filter_value_is_an_error_listing_the_known_ones(capsys, flag, value, known):
    # not an empty table with exit 0, which reads as "the catalog has none"
    assert run("catalog", flag, value) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{flag}: no SKU in the catalog has {value!r}" in err and known in err


def test_catalog_directory_as_file_is_an_error_not_a_traceback(capsys, tmp_path):
    assert run("catalog", "--catalog", str(tmp_path)) == 2
    assert "is a directory" in capsys.readouterr().err


def test_catalog_filters_that_match_nothing_together_are_an_error(capsys):
    assert run("catalog", "--gpu", "T4", "--cloud", "gcp") == 2  # was an empty table, exit 0
    err = " ".join(capsys.readouterr().err.split())
    assert "no T4 SKU on gcp in the catalog" in err and "T4 SKUs are on: azure" in err


def test_catalog_table_marks_a_retired_size(capsys):
    assert run("catalog", "--gpu", "V100") == 0
    out = capsys.readouterr().out
    assert "NC6s_v3 (retired 2025-09-30)" in out and "NC24rs_v3 (retired" not in out


def test_catalog_file_whose_sku_is_no_array_of_tables_is_an_error_not_a_traceback(capsys, tmp_path):
    f = tmp_path / "c10.toml"
    f.write_text("sku = 1\n")  # a TypeError traceback from catalog, cost, simulate and plan
    for args in (("catalog",), ("cost", "--sku", "NC24rs_v3", "--hours", "1")):
        assert run(*args, "--catalog", f) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"error: {f}: 'sku' must be an array of tables ([[sku]]), got int 1" in err and "fix:" in err


def test_catalog_gpu_filter_skips_a_size_set_to_no_gpus(capsys, tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('[[sku]]\nname = "NC24rs_v3"\ngpus = 0\n')
    assert run("catalog", "--gpu", "V100", "--json", "--catalog", f) == 0
    names = [r["name"] for r in json.loads(capsys.readouterr().out)]
    assert "Standard_NC6s_v3" in names and "Standard_NC24rs_v3" not in names
