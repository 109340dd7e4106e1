"""examples/dlrm end to end through the real console script, on real TorchRec over gloo ranks: the
sharded DLRM learns the synthetic data's planted signal (held-out AUC within 0.03 of the best any model
can reach), its checkpoint loads unsharded in one process, the npy conversion trains to the very same
parameters, and on 4 ranks (2 nodes x 2) a run that is preempted and then loses a rank to kill -9 ends
with exactly the parameters of a run that never stopped."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from azulite.data.criteo_npy import convert
from azulite.data.criteo_reader import open_reader
from azulite.data.criteo_synth import generate
from azulite.workloads.dlrm import loop
from azulite.workloads.dlrm.model import load_plain_model
from tests.examples.runner import az, final_hashes, run_example
from tests.launch.jobkit import home, wait_for

_ = home  # fixture
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("criteo")
    generate(root / "tsv", rows=4000, files=2, seed=0)
    convert(root / "tsv", root / "npy")
    return {"tsv": root / "tsv", "npy": root / "npy"}


def result_of(rec: dict) -> dict:
    line = next(ln for ln in rec["rank_logs"][0].splitlines() if ln.startswith("result "))
    return json.loads(line[len("result "):])


def isolated_run(tmp_path_factory, *sets: str) -> dict:
    mp = pytest.MonkeyPatch()
    mp.setenv("AZULITE_HOME", str(tmp_path_factory.mktemp("ref") / "azhome"))
    try:
        return run_example("dlrm", *sets, timeout=400)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def tsv_run(tmp_path_factory, data) -> dict:
    rec = isolated_run(tmp_path_factory, f"inputs.dataset.path={data['tsv']}")
    assert len(set(final_hashes(rec).values())) == 1
    return rec


@pytest.mark.timeout(900)
def test_sharded_dlrm_learns_the_planted_signal_and_its_checkpoint_loads_unsharded(tsv_run, data):
    res = result_of(tsv_run)
    assert res["val_rows"] == 1600 and res["steps"] == 200
    assert res["val_auc"] >= res["best_auc"] - 0.03, res
    assert "sharding:" in tsv_run["rank_logs"][0]
    # rank 0's metrics reached the job's MLflow store (logged asynchronously: flushed before the job ended)
    metrics = tsv_run["metrics"]
    assert {"train_loss", "train_auc", "samples_per_s", "val_auc", "val_log_loss"} <= set(metrics), metrics
    assert metrics["val_auc"]["value"] == pytest.approx(res["val_auc"]) and metrics["val_auc"]["step"] == 200
    assert metrics["train_loss"]["step"] == 200
    last = [c for c in tsv_run["checkpoints"] if c["committed"]][-1]
    assert last["step"] == 200
    # the 2-rank sharded checkpoint, rebuilt from its manifest alone in this process (no process group)
    model, mc = load_plain_model(last["uri"])
    assert mc["preprocess"]["num_embeddings_per_feature"] == [1000] * 26
    val = open_reader(data["tsv"], rank=0, world_size=1, batch_size=256, split="val", validation_permille=200,
                      num_embeddings_per_feature=mc["preprocess"]["num_embeddings_per_feature"], shuffle_files=False)
    unsharded = loop.evaluate(model, val)
    assert unsharded["rows"] == 1600
    assert unsharded["auc"] == pytest.approx(res["val_auc"], abs=1e-4)
    assert unsharded["log_loss"] == pytest.approx(res["val_log_loss"], abs=1e-4)


@pytest.mark.timeout(900)
def test_the_npy_conversion_trains_to_the_same_parameters(tmp_path_factory, tsv_run, data):
    rec = isolated_run(tmp_path_factory, f"inputs.dataset.path={data['npy']}", "inputs.checkpoint_every=0")
    assert final_hashes(rec)[0] == final_hashes(tsv_run)[0]
    assert result_of(rec)["val_auc"] == result_of(tsv_run)["val_auc"]


FOUR = ("distribution.process_count_per_instance=2",)


def show(job_id: str) -> dict:
    p = az("job", "show", job_id, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.timeout(1200)
def test_on_4_ranks_a_preemption_then_a_kill9_resume_to_the_uninterrupted_parameters(home, tmp_path_factory, data):
    reference = final_hashes(isolated_run(tmp_path_factory, f"inputs.dataset.path={data['tsv']}", *FOUR))
    assert len(set(reference.values())) == 1
    args = ["job", "submit", "examples/dlrm/job.yaml", "--json"]
    for s in (f"inputs.dataset.path={data['tsv']}", *FOUR, "inputs.checkpoint_every=10", "inputs.step_sleep=0.1",
              "max_restarts=2"):
        args += ["--set", s]
    p = az(*args)
    assert p.returncode == 0, p.stdout + p.stderr
    job = json.loads(p.stdout)["id"]
    # evicted once its first checkpoint is committed: every rank commits its step, exits 75, requeued
    p = az("job", "wait", job, "--checkpoint", "--timeout", "300")
    assert p.returncode == 0, p.stderr
    p = az("job", "preempt", job)
    assert p.returncode == 0, p.stderr  # 2 if the job had already ended
    # attempt 2 resumes; then one of its ranks is killed: the elastic agent restarts the group, which
    # resumes again from the newest checkpoint
    ranks2 = lambda r: {p["rank"]: p for p in r["processes"] if p["kind"] == "rank" and p["attempt"] == 2}  # noqa: E731
    # each look is a CLI process: once a second, not back to back, leaves the cores to the job's ranks
    rec = wait_for(lambda: (r := show(job)) and len(ranks2(r)) == 4 and r, 300, "attempt 2's ranks", every=1.0)
    log0 = Path(ranks2(rec)[0]["log"])
    wait_for(lambda: log0.exists() and "resumed from step" in log0.read_text(), 300, "attempt 2 to resume")
    os.kill(ranks2(rec)[1]["pid"], signal.SIGKILL)
    p = az("job", "wait", job, "--json", "--timeout", "400")
    rec = show(job)
    assert rec["state"] == "succeeded", rec["reason"]
    assert [(a["attempt"], a["state"]) for a in rec["attempts"]] == [(1, "requeued"), (2, "succeeded")]
    assert {p["exit_code"] for p in rec["processes"] if p["kind"] == "rank" and p["attempt"] == 1} == {75}
    assert max(p["restarts"] for p in ranks2(rec).values()) >= 1
    logs = {r: Path(p["log"]).read_text() for r, p in ranks2(rec).items()}
    assert logs[0].count("resumed from step") == 2  # after the eviction, and after the kill
    assert {t.strip().splitlines()[-1] for t in logs.values()} == {f"final_params_sha256={reference[0]}"}
    # the example's metrics and the checkpointer's figures reach the job's store through the one writer
    assert {"train_loss", "samples_per_s", "checkpoint_save_s"} <= set(rec["metrics"]), rec["metrics"]
