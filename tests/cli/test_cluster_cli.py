"""``azulite cost | simulate | plan`` in-process: JSON figures, the PNG plot, measured save durations read
from checkpoint manifests, and user mistakes as messages with exit code 2 (no traceback)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from azulite.cli.cluster import measured_save_seconds
from tests.cli.inprocess import exit_code as run

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "examples" / "cluster" / "cluster.yaml"
TRACE = ROOT / "examples" / "cluster" / "trace.csv"
DATA = ROOT / "tests" / "cluster" / "data"
DAY = "hour,rps\n" + "".join(f"{h},10\n" for h in range(24))  # a request-rate curve: every hour of a day


def err_of(capsys) -> str:
    """stderr with rich's line wrapping undone."""
    return " ".join(capsys.readouterr().err.split())


def test_cost_json_reproduces_the_seed(capsys):
    assert run("cost", "--sku", "Standard_NC24rs_v3", "--nodes", "2", "--hours", "50", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["total_usd"] == pytest.approx(306.0) and d["breakdown"]["compute_usd"] == pytest.approx(306.0)
    assert d["alternatives_usd"]["spot"] > 92 and d["alternatives_usd"]["reserved_1y"] is None
    assert run("cost", "--sku", "NC24rs_v3", "--nodes", "2", "--hours", "50", "--spot", "--eviction-rate", "0", "--json") == 0
    assert json.loads(capsys.readouterr().out)["total_usd"] == pytest.approx(92.0)


def test_cost_from_a_job_spec_and_samples(capsys, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("command: python train.py\nresources: {instance_type: Standard_ND96asr_v4, instance_count: 2}\n")
    assert run("cost", spec, "--samples-per-second", "1000", "--samples", "1800000", "--epochs", "2", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["nodes"] == 2 and d["compute_hours"] == pytest.approx(1.0) and d["total_usd"] == pytest.approx(54.0)


def test_cost_serving_month(capsys):
    assert run("cost", "--serve", "--sku", "NC4as_T4_v3") == 0
    out = capsys.readouterr().out
    assert "$383.98 per month" in out and "720 h -> $378.72" in out


def test_cost_serving_from_a_request_rate_curve(capsys, tmp_path):
    day = tmp_path / "day.csv"
    day.write_text("hour,rps\n" + "".join(f"{h},{0 if h < 8 else 120}\n" for h in range(24)))
    assert run("cost", "--serve", "--sku", "NC4as_T4_v3", "--mode", "scale-to-zero", "--curve", day, "--capacity", "50",
               "--hours-per-month", "720", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["hourly_replicas"] == [0] * 8 + [3] * 16
    assert d["total_usd"] == pytest.approx(48 / 24 * 720 * 0.526)


@pytest.mark.parametrize("args, words", [
    (("cost", "--sku", "NC24r_v3", "--nodes", "2", "--hours", "5"), "did you mean Standard_NC24rs_v3"),
    (("cost", "--sku", "NC24rs_v3", "--nodes", "2", "--hours", "0"), "--hours"),
    (("cost", "--sku", "NC24rs_v3", "--nodes", "2"), "give --hours"),
    (("cost", "--sku", "ND96isr_H100_v5", "--hours", "1"), "no on_demand price"),
    # 0 nodes / replicas were priced as 1 without a word
    (("cost", "--sku", "NC24rs_v3", "--nodes", "0", "--hours", "5"), "error: --nodes: must be >= 1 (nodes for training"),
    (("cost", "--serve", "--sku", "NC4as_T4_v3", "--nodes", "0"), "error: --nodes: must be >= 1 (nodes for training, the most replicas"),
    # no spec at all read as "the spec has no resources.instance_type"
    (("cost", "--hours", "5"), "which VM size? no --sku and no job spec"),
    # --hours won and the samples flags were silently ignored
    (("cost", "--sku", "NC24rs_v3", "--hours", "5", "--samples-per-second", "10", "--samples", "100"), "not both"),
    (("cost", "--sku", "NC24rs_v3", "--hours", "5", "--spot", "--pricing", "savings_1y"), "--spot and --pricing savings_1y"),
    (("cost", "--serve", "--sku", "NC4as_T4_v3", "--hours", "5"), "price a training run, not an endpoint"),
])
def test_cost_errors_exit_2(capsys, args, words):
    assert run(*args) == 2
    err = err_of(capsys)
    assert words in err and "Traceback" not in err


def test_simulate_json_and_plot(capsys, tmp_path):
    png = tmp_path / "sim.png"
    assert run("simulate", CLUSTER, TRACE, "--json", "--plot", png) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["finished"] == d["jobs"] == 9 and d["cost_usd"] > 0 and 0 < d["gpu_utilization"] <= 1
    assert d["preemptions"] >= 1  # "urgent" (priority 20) takes nodes from lower-priority jobs
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert run("simulate", CLUSTER, TRACE) == 0
    assert "GPU utilization" in capsys.readouterr().out


def test_simulate_imports_a_public_trace(capsys):
    assert run("simulate", CLUSTER, DATA / "openb_pod_list_default.head40.csv", "--format", "pai2023", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["jobs"] == 38 and d["skipped"] == {"CPU-only pod": 2, "never scheduled": 2}


def test_simulate_errors_exit_2(capsys, tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("job_id,submit_time,gpus,duration\na,5,4,10\nb,1,4,10\n")
    assert run("simulate", CLUSTER, bad) == 2
    assert f"{bad}:3: submit_time 1 is earlier" in err_of(capsys)
    typo = tmp_path / "typo.csv"  # placed and priced the job as if it tolerated nothing
    typo.write_text(TRACE.read_text().replace("spot:NoSchedule", "spot:NoSchedul"))
    assert run("simulate", CLUSTER, typo, "--json") == 2
    err = err_of(capsys)
    assert f"{typo}:4: column 'tolerations': 'kubernetes.azure.com/scalesetpriority=spot:NoSchedul': effect 'NoSchedul'" in err
    assert "(did you mean NoSchedule?)" in err and "Traceback" not in err
    huge = tmp_path / "huge.csv"
    huge.write_text("job_id,submit_time,gpus,duration\nmonster,0,512,10\n")
    assert run("simulate", CLUSTER, huge) == 2
    assert "job 'monster' needs 512 GPUs and can never fit" in err_of(capsys)


def _manifest(root: Path, step: int, save_seconds: float | None) -> None:
    d = root / f"step-{step:08d}"
    d.mkdir(parents=True)
    m = {"format": "azulite.checkpoint/1", "step": step, "files": {}}
    if save_seconds is not None:
        m["save_seconds"] = save_seconds
    (d / "manifest.json").write_text(json.dumps(m))


def test_plan_reads_measured_save_seconds_from_manifests(capsys, tmp_path):
    ck = tmp_path / "ckpt"
    for step, s in ((10, 30.0), (20, 50.0), (30, 40.0), (40, None)):
        _manifest(ck, step, s)
    assert measured_save_seconds(str(ck)) == (40.0, f"median of 3 measured saves under {ck}")
    spec = tmp_path / "job.yaml"
    spec.write_text("command: python train.py\nresources: {instance_type: Standard_NC24rs_v3, instance_count: 2}\n")
    assert run("plan", spec, "--hours", "50", "--deadline", "20h", "--checkpoints", ck, "--eviction-rate", "0.05",
               "--runs", "4", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["pick"]["spot"] and d["pick"]["hours_p90"] <= 20
    assert any("delta = 40 s (median of 3 measured saves" in a for a in d["assumptions"])
    assert run("plan", spec, "--hours", "50", "--deadline", "20h", "--runs", "2") == 0
    out = capsys.readouterr().out
    assert "pick:" in out and "Alternatives weighed" in out and "default 60 s" in out


def test_plan_without_instance_type_is_an_error(capsys, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("command: python train.py\n")
    assert run("plan", spec, "--hours", "5") == 2
    assert "resources.instance_type" in err_of(capsys)


def test_cost_curve_that_is_a_directory_is_an_error(capsys, tmp_path):
    assert run("cost", "--serve", "--sku", "NC4as_T4_v3", "--mode", "autoscale", "--curve", tmp_path, "--capacity", "50") == 2
    err = err_of(capsys)
    assert "--curve is a directory" in err and "fix:" in err and "Traceback" not in err


def test_simulate_refuses_an_unwritable_plot_before_running(capsys, tmp_path):
    # found after the whole run as a matplotlib traceback before; now an error up front, nothing printed
    assert run("simulate", CLUSTER, TRACE, "--plot", tmp_path / "nodir" / "sim.png", "--no-progress") == 2
    captured = capsys.readouterr()
    assert "does not exist" in captured.err and "mkdir -p" in captured.err and captured.out == ""
    assert run("simulate", CLUSTER, TRACE, "--plot", tmp_path, "--no-progress") == 2
    err = err_of(capsys)
    assert "is a directory" in err and "--plot" in err


def test_plan_checkpoints_path_that_does_not_exist_is_an_error(capsys, tmp_path):
    # it read as "no save_seconds there" and planned on the 60 s default
    spec = ROOT / "examples" / "ddp" / "job.yaml"  # its inputs are in the repository (dlrm's are made by the demo)
    assert run("plan", spec, "--hours", "50", "--checkpoints", tmp_path / "typo") == 2
    err = err_of(capsys)
    assert "checkpoint location not found" in err and "--save-seconds" in err


def _options_without_help(*path: str) -> list[str]:
    import typer.main

    from azulite.cli import app

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return [p.opts[0] for p in cmd.params if getattr(p, "help", None) is None and p.opts[0] != "--help"
            and p.param_type_name == "option"]


@pytest.mark.parametrize("command", [("catalog",), ("cost",), ("simulate",), ("plan",), ("deploy", "render"),
                                     ("cluster", "render"), ("job", "cancel"), ("job", "preempt")])
def test_every_option_has_a_help_line(command):
    assert _options_without_help(*command) == []


@pytest.mark.parametrize("args, words", [
    (("plan", ROOT / "examples" / "ddp" / "job.yaml", "--hours", "5", "--runs", "0"), "--runs: must be >= 1, got 0"),
    (("plan", ROOT / "examples" / "ddp" / "job.yaml", "--hours", "5", "--scaling-efficiency", "1.5"),
     "--scaling-efficiency: must be in (0, 1], got 1.5"),
    # negative values were accepted and planned / simulated with
    (("plan", ROOT / "examples" / "ddp" / "job.yaml", "--hours", "5", "--eviction-rate", "-1"), "--eviction-rate"),
    (("simulate", CLUSTER, TRACE, "--checkpoint-cost", "-5", "--json"), "--checkpoint-cost"),
])
def test_plan_and_simulate_bad_numbers_exit_2_naming_the_flag(capsys, args, words):
    assert run(*args) == 2
    captured = capsys.readouterr()
    assert words in " ".join(captured.err.split()) and captured.out == ""


def test_cost_curve_missing_hours_is_an_error_naming_them(capsys, tmp_path):
    # was priced as "mean over the 3-hour curve x 730 h"
    (tmp_path / "day.csv").write_text("0,0\n1,0\n2,100\n")
    assert run("cost", "--serve", "--sku", "NC4as_T4_v3", "--mode", "autoscale", "--curve", tmp_path / "day.csv",
               "--capacity", "50") == 2
    err = err_of(capsys)
    assert "day.csv: the curve is a day of 24 hours and has no rate for hours 3-23 fix: add a row for hours 3-23" in err


def test_cost_curve_rows_may_come_in_any_order(capsys, tmp_path):
    day = tmp_path / "day.csv"
    day.write_text("".join(f"{h},{50 * h}\n" for h in reversed(range(24))))
    assert run("cost", "--serve", "--sku", "NC4as_T4_v3", "--mode", "scale-to-zero", "--curve", day, "--capacity", "50",
               "--json") == 0
    assert json.loads(capsys.readouterr().out)["hourly_replicas"] == list(range(24))


def test_cost_curve_row_with_a_non_number_hour_is_named(capsys, tmp_path):
    day = tmp_path / "day.csv"
    day.write_text("hour,rps\n0,10\nnoon,5\n")  # was read as a 2-hour curve
    assert run("cost", "--serve", "--sku", "NC4as_T4_v3", "--mode", "autoscale", "--curve", day, "--capacity", "50") == 2
    assert f"{day}:3: hour must be a whole number from 0 to 23, got 'noon'" in err_of(capsys)


def test_plan_of_the_readme_says_one_candidate_in_the_singular(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "200")
    # the README's spec as shipped, its dataset folder present (in the repository it exists only after `make demo`)
    (tmp_path / "examples" / "dlrm").mkdir(parents=True)
    for name in ("job.yaml", "train.py"):
        shutil.copy(ROOT / "examples" / "dlrm" / name, tmp_path / "examples" / "dlrm" / name)
    (tmp_path / ".cache" / "criteo-synth").mkdir(parents=True)
    assert run("plan", tmp_path / "examples" / "dlrm" / "job.yaml", "--hours", "50", "--deadline", "48") == 0
    out = capsys.readouterr().out
    assert "; 1 candidate simulated" in out, out  # was "1 candidates simulated"


@pytest.mark.parametrize("curve, args, words", [
    # a NaN / inf rate was a ValueError / OverflowError traceback from the cost model
    ("hour,rps\n0,nan\n", ("--mode", "autoscale", "--capacity", "5"), "day.csv:2: request rate must be a finite number >= 0, got 'nan'"),
    ("hour,rps\n0,inf\n", ("--mode", "autoscale", "--capacity", "5"), "day.csv:2: request rate must be a finite number >= 0"),
    # inputs a mode does not use were dropped without a word
    (DAY, ("--capacity", "5"), "always-on runs every replica all month"),
    (DAY, ("--mode", "autoscale", "--capacity", "5", "--utilization", "0.5"), "not both"),
    (None, ("--mode", "autoscale", "--capacity", "5"), "--capacity is the req/s of one replica against a request-rate curve"),
    (None, ("--hours-per-month", "10000"), "at most 744 (31 days), got 10000"),
])
def test_cost_serving_inputs_that_would_be_dropped_or_crash_are_named(capsys, tmp_path, curve, args, words):
    extra = ()
    if curve is not None:
        (tmp_path / "day.csv").write_text(curve)
        extra = ("--curve", tmp_path / "day.csv")
    assert run("cost", "--serve", "--sku", "NC4as_T4_v3", *extra, *args) == 2
    err = err_of(capsys)
    assert words in err and "Traceback" not in err


def test_cost_curve_header_names_its_columns_and_a_spreadsheet_bom_is_read(capsys, tmp_path):
    swapped = tmp_path / "swapped.csv"
    swapped.write_text("rps,hour\n100,0\n" + "".join(f"0,{h}\n" for h in range(1, 24)))  # hours were read as rates
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfhour,rps\r\n0,100\r\n" + b"".join(b"%d,0\r\n" % h for h in range(1, 24)))
    for f in (swapped, bom):
        assert run("cost", "--serve", "--sku", "NC4as_T4_v3", "--mode", "scale-to-zero", "--curve", f, "--capacity", "50",
                   "--json") == 0
        assert json.loads(capsys.readouterr().out)["hourly_replicas"] == [2] + [0] * 23


def test_cost_serving_nodes_cap_a_curve_and_the_hours_over_it_are_said(capsys, tmp_path):
    day = tmp_path / "day.csv"
    day.write_text("0,100\n1,300\n" + "".join(f"{h},0\n" for h in range(2, 24)))
    assert run("cost", "--serve", "--sku", "NC4as_T4_v3", "--mode", "autoscale", "--curve", day, "--capacity", "50",
               "--nodes", "3", "--json") == 0  # --nodes was ignored with a curve
    d = json.loads(capsys.readouterr().out)
    assert d["hourly_replicas"] == [2, 3] + [1] * 22
    assert any("1 of 24 hours need more than 3 replicas (up to 6)" in a for a in d["assumptions"])


def test_cost_table_of_other_prices_uses_the_same_inputs_and_says_why_one_has_no_figure(capsys):
    args = ("cost", "--sku", "NC24rs_v3", "--nodes", "2", "--hours", "50", "--spot", "--checkpoint-interval", "10m", "--json")
    assert run(*args) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["alternatives_usd"]["spot"] == pytest.approx(d["total_usd"])  # was priced at Young/Daly's interval
    assert run("cost", "--sku", "NC24rs_v3", "--nodes", "100000", "--hours", "1000", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["alternatives_usd"]["spot"] is None and "expected never to finish" in d["alternatives_not_priced"]["spot"]
    assert "reserved_1y" not in d["alternatives_not_priced"]  # no source: a price that is unknown, said as such


def test_cost_of_a_spot_spec_can_be_priced_on_demand(capsys, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("command: python t.py\npriority: spot\nresources: {instance_type: Standard_NC24rs_v3, instance_count: 1}\n")
    assert run("cost", spec, "--hours", "10", "--eviction-rate", "0", "--json") == 0
    assert json.loads(capsys.readouterr().out)["pricing"] == "spot"
    assert run("cost", spec, "--hours", "10", "--pricing", "on_demand", "--json") == 0  # was still spot
    assert json.loads(capsys.readouterr().out)["total_usd"] == pytest.approx(30.6)


@pytest.mark.parametrize("args, hours", [(("--hours", "1h30m"), 1.5), (("--hours", "1d 12h"), 36.0), (("--hours", "90m"), 1.5),
                                         (("--samples-per-second", "1", "--samples", "5400"), 1.5)])
def test_cost_takes_compound_durations(capsys, args, hours):
    # 90m worked and 1h30m was refused
    assert run("cost", "--sku", "NC24rs_v3", *args, "--json") == 0
    assert json.loads(capsys.readouterr().out)["compute_hours"] == pytest.approx(hours)


@pytest.mark.parametrize("args, words", [
    # each named its flag twice: "error: --hours: --hours takes hours"
    (("cost", "--sku", "NC24rs_v3", "--hours", "1h1h"), "error: --hours: takes hours (50, 2.5) or a duration (90m, 1h30m, 2d)"),
    (("cost", "--sku", "NC24rs_v3", "--hours", "1", "--spot", "--checkpoint-interval", "0h0m"),
     "error: --checkpoint-interval: takes seconds or a duration (30m, 1h30m), > 0, got '0h0m'"),
    (("plan", ROOT / "examples" / "ddp" / "job.yaml", "--hours", "50", "--deadline", "soon"),
     "error: --deadline: takes hours (50, 2.5) or a duration (90m, 1h30m, 2d), > 0, got 'soon' fix: e.g. --deadline 48"),
])
def test_duration_flags_are_named_once(capsys, args, words):
    assert run(*args) == 2
    err = err_of(capsys)
    assert words in err and err.count("--hours") + err.count("--deadline") + err.count("--checkpoint-interval") == 2


@pytest.mark.parametrize("args, words", [
    (("--hours", "1e3"), None),  # scientific notation was "must be > 0, got '1e3'"
    (("--samples-per-second", "nan", "--samples", "1000"), "--samples-per-second, --samples and --epochs must be > 0"),
    (("--hours", "1", "--spot", "--save-seconds", "-5"), "--save-seconds must be > 0, got -5"),
    (("--hours", "1", "--spot", "--eviction-rate", "1000"), "on 1 node the job is expected never to finish (an eviction every 3.6 s"),
])
def test_cost_numbers_are_read_and_refused_naming_what_is_wrong(capsys, args, words):
    assert run("cost", "--sku", "NC24rs_v3", *args) == (0 if words is None else 2)
    if words is not None:
        assert words in err_of(capsys)


def test_a_retired_size_is_priced_with_a_warning_and_never_planned(capsys, tmp_path):
    assert run("cost", "--sku", "NC6s_v3", "--hours", "2", "--json") == 0
    captured = capsys.readouterr()
    assert "Standard_NC6s_v3 was retired on 2025-09-30" in captured.err
    assert json.loads(captured.out)["warnings"] == [captured.err.split("warning: ")[1].strip()]
    assert run("plan", ROOT / "examples" / "ddp" / "job.yaml", "--hours", "50", "--runs", "2", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["pick"]["sku"] != "Standard_NC6s_v3" and all(c["sku"] != "Standard_NC6s_v3" for c in d["alternatives"])
    assert "not weighed, no longer available: NC6s_v3 (retired 2025-09-30)" in d["assumptions"]


@pytest.mark.parametrize("speedup, words", [
    (("B200=2",), "--speedup B200=2: no SKU in the catalog has GPU type 'B200'"),
    (("V100=2",), "V100 is the GPU type the run time was measured on"),
    (("A100=2", "a100=3"), "--speedup gives A100 twice"),
    (("A100=0",), "the factor must be > 0"),
    (("A100",), "takes TYPE=FACTOR"),
])
def test_plan_speedup_names_a_type_the_catalog_has(capsys, speedup, words):
    args = [a for s in speedup for a in ("--speedup", s)]
    assert run("plan", ROOT / "examples" / "ddp" / "job.yaml", "--hours", "50", *args) == 2
    assert words in err_of(capsys)


def test_plan_speedup_ignores_case_like_catalog_gpu(capsys):
    assert run("plan", ROOT / "examples" / "ddp" / "job.yaml", "--hours", "50", "--runs", "2", "--speedup", "a100=2.5",
               "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert "GPU types weighed: A100 (x2.5), V100 (x1)" in d["assumptions"]
    assert any("A100" in c["sku"] for c in d["alternatives"])


def test_plan_with_no_priced_candidate_says_so(capsys, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("command: python t.py\nresources: {instance_type: Standard_ND96isr_H100_v5, instance_count: 1}\n")
    assert run("plan", spec, "--hours", "5") == 1
    assert "no candidate could be weighed: no price is known for any candidate" in " ".join(capsys.readouterr().out.split())


def test_plan_with_a_deadline_no_candidate_meets_names_the_fastest(capsys):
    assert run("plan", ROOT / "examples" / "ddp" / "job.yaml", "--hours", "50", "--deadline", "5h") == 1
    out = " ".join(capsys.readouterr().out.split())
    assert ("no pick: none finishes within the deadline of 5 h: the fastest, 16 x NC24rs_v3 on-demand, needs 8.6 h "
            "without evictions") in out and "could be weighed" not in out
    assert run("plan", ROOT / "examples" / "ddp" / "job.yaml", "--hours", "50", "--deadline", "5h", "--json") == 1
    assert json.loads(capsys.readouterr().out)["no_pick"].startswith("none finishes within the deadline of 5 h")


def test_simulate_refuses_a_plot_format_before_running(capsys, tmp_path):
    assert run("simulate", CLUSTER, TRACE, "--plot", tmp_path / "sim.txt", "--json") == 2
    captured = capsys.readouterr()
    assert "cannot write a plot as .txt" in " ".join(captured.err.split()) and captured.out == ""
    assert run("simulate", CLUSTER, TRACE, "--plot", tmp_path / "sim.svg", "--json") == 0
    assert (tmp_path / "sim.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize("pools, autoscaler, words", [
    ("{name: cpu, sku: Standard_D4s_v3, min_nodes: 1, max_nodes: 4}", "", "no pool has GPUs (cpu: Standard_D4s_v3)"),
    ("{name: a, sku: Standard_NC24rs_v3, min_nodes: 0, max_nodes: 4}", "autoscaler: {enabled: false}\n",
     "start with at most 0 GPUs and the autoscaler is off"),
    ("{name: s, sku: Standard_NC24rs_v3, spot: true, pricing: savings_1y}", "", "a spot pool pays the spot price, not savings_1y"),
    ("{name: s, sku: Standard_NC24rs_v3, spot: true, eviction_rate_per_hour: -0.1}", "",
     "-0.1 is too small: must be >= 0 fix: set pools[0].eviction_rate_per_hour to a number >= 0"),
])
def test_simulate_cluster_mistakes_say_what_they_are(capsys, tmp_path, pools, autoscaler, words):
    spec = tmp_path / "c.yaml"
    spec.write_text(f"name: c\n{autoscaler}pools:\n  - {pools}\n")
    assert run("simulate", spec, TRACE, "--json") == 2
    assert words in err_of(capsys)


def test_simulate_reads_a_trace_saved_by_a_spreadsheet(capsys, tmp_path):
    trace = tmp_path / "bom.csv"
    trace.write_bytes(b"\xef\xbb\xbfjob_id,submit_time,gpus,duration\r\na,0,4,2h\r\n")  # Excel's "CSV UTF-8"
    assert run("simulate", CLUSTER, trace, "--json") == 0
    assert json.loads(capsys.readouterr().out)["finished"] == 1
