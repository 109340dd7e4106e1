"""Checkpoints on Azure Blob, against a real Azurite: resume, the If-None-Match commit, and (e) the
storage going away in the middle of a save."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch

from azulite.errors import StorageError
from azulite.train import CheckpointConfig, Checkpointer, ModelState, Progress, StorageSettings, init, list_checkpoints
from azulite.train.storage import CheckpointStorage
from tests.train.azurite import Azurite
from tests.train.conftest import INTERVAL, STEPS

pytestmark = pytest.mark.slow


def _env(az: Azurite, tmp_path: Path) -> dict[str, str]:
    return {"AZURE_STORAGE_CONNECTION_STRING": az.connection_string, "AZULITE_STAGING_DIR": str(tmp_path / "staging"),
            "AZULITE_STORAGE_RETRIES": "1"}


def _args(uri: str, out: Path, *extra: str) -> list[str]:
    return ["--ckpt", uri, "--steps", str(STEPS), "--interval", str(INTERVAL), "--out", str(out), *extra]


def test_blob_manifest_commit_is_if_none_match(azurite):
    storage = CheckpointStorage("az://ckpts/exclusive", StorageSettings(connection_string=azurite.connection_string))
    storage.check()
    storage.write_exclusive("step-00000001/manifest.json", b'{"first": 1}')
    with pytest.raises(StorageError, match="already exists"):
        storage.write_exclusive("step-00000001/manifest.json", b'{"second": 2}')
    assert storage.read_bytes("step-00000001/manifest.json") == b'{"first": 1}'


def test_credentials_the_account_refuses_are_a_mistake_no_restart_fixes(azurite):
    """A wrong account key: the account answers 403. It was a StorageError (exit 1): the job was restarted
    and retried into the same refusal; now the script exits 78 and the job fails at once."""
    from azulite.errors import StorageConfigError
    from azulite.train import EXIT_CONFIG, exit_code

    wrong = azurite.connection_string.replace("AccountKey=", "AccountKey=AAAA", 1)
    storage = CheckpointStorage("az://ckpts/refused", StorageSettings(connection_string=wrong))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(StorageConfigError, match="refused the credentials") as e:
            storage.check()
    assert exit_code(e.value) == EXIT_CONFIG and "account key" in e.value.fix
    # the variable azulite reads (the fix named AZURE_STORAGE_KEY, which nothing reads)
    assert "AZURE_STORAGE_ACCOUNT_KEY" in e.value.fix and "AZURE_STORAGE_KEY," not in e.value.fix
    # adlfs's "Failed to fetch container properties for ckpts. Assume it exists already" came before it
    assert [str(w.message) for w in caught] == []
    # listing (job show) says the same (it was "cannot list checkpoints", storage down)
    with pytest.raises(StorageConfigError, match="refused the credentials"):
        list_checkpoints("az://ckpts/refused", settings=StorageSettings(connection_string=wrong))


@pytest.fixture
def own_azurite(tmp_path):
    az = Azurite(tmp_path / "azurite-data").start()
    try:
        yield az
    finally:
        az.stop()


def _stop_storage_during_save(proc, az: Azurite, pause: Path, step: int) -> None:
    """Both ranks wrote their shards locally and wait before uploading: take the storage away, go on."""
    for rank in (0, 1):
        marker = pause / f"paused-shards_written-{step}-rank{rank}"
        proc.wait_for(lambda _, m=marker: m.exists())
    az.stop()
    (pause / f"go-shards_written-{step}").write_text("")


def test_storage_down_mid_upload_fails_loudly_and_training_continues(baseline, runner, own_azurite, tmp_path):
    """Policy 'continue' (the default): the failed save is logged on every rank, nothing is committed
    for that step, training goes on and the next save after the storage returns commits."""
    uri, out, env, pause = "az://ckpts/outage", tmp_path / "out.json", _env(own_azurite, tmp_path), tmp_path / "pause"
    pause.mkdir()
    bad, later = 2 * INTERVAL, 3 * INTERVAL
    proc = runner.start(_args(uri, out, "--pause-at", f"shards_written:{bad}", "--pause-at", f"save_start:{later}",
                              "--pause-dir", str(pause)), env=env)
    _stop_storage_during_save(proc, own_azurite, pause, bad)
    # the storage comes back (same port, same data) before the next save starts
    for rank in (0, 1):
        proc.wait_for(lambda _, r=rank: (pause / f"paused-save_start-{later}-rank{r}").exists())
    assert proc.output().count(f"CHECKPOINT SAVE FAILED at step {bad}") == 2  # loud, on every rank
    own_azurite.start()
    (pause / f"go-save_start-{later}").write_text("")
    res = proc.wait(timeout=240)

    assert res.returncode == 0, res.output[-4000:]
    assert f"the last committed checkpoint is step {INTERVAL}" in res.output
    assert json.loads(out.read_text())["sha256"] == baseline["sha256"]
    infos = list_checkpoints(uri, environ=env)
    listed = {c.step: c.committed for c in infos}
    assert listed.get(bad) is not True  # no half checkpoint: absent, or present but not committed
    assert listed[later] is True and listed[STEPS] is True
    assert all(c.bytes > 10_000 and c.uri == f"{uri}/step-{c.step:08d}" for c in infos if c.committed)


def test_storage_down_with_policy_stop_exits_then_resumes_identical(baseline, runner, own_azurite, tmp_path):
    uri, out, env, pause = "az://ckpts/outage-stop", tmp_path / "out.json", _env(own_azurite, tmp_path), tmp_path / "pause"
    pause.mkdir()
    bad = 2 * INTERVAL
    proc = runner.start(_args(uri, out, "--on-save-error", "stop", "--pause-at", f"shards_written:{bad}",
                              "--pause-dir", str(pause)), env=env)
    _stop_storage_during_save(proc, own_azurite, pause, bad)
    res = proc.wait(timeout=240)
    assert res.returncode != 0
    assert f"error: {uri}/step-{bad:08d}: saving checkpoint step {bad} failed" in res.output, res.output[-4000:]
    assert "Traceback" not in res.stdout

    own_azurite.start()
    listed = {c.step: c.committed for c in list_checkpoints(uri, environ=env)}
    assert listed[INTERVAL] is True and listed.get(bad) is not True
    again = runner.run(_args(uri, out), env=env)
    assert again.returncode == 0, again.output[-3000:]
    assert json.loads(out.read_text()) == {"sha256": baseline["sha256"], "step": STEPS, "resumed_from": INTERVAL}
    # both ranks' staging folders of every save and restore are gone (an empty step-N/rank-1/ and a
    # restore-step-N/ stayed per save), leaving only the location's own folder
    assert _staging_left(tmp_path / "staging") == []


def _staging_left(staging: Path) -> list[str]:
    """What is under the staging directory below each location's folder (``<hash>/``)."""
    return sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if len(p.relative_to(staging).parts) > 1)


def test_blob_restore_verifies_what_it_downloads_and_falls_back(azurite, tmp_path, caplog):
    """One process: a Blob checkpoint is fetched (only the files the load reads, ranged GETs in parallel)
    and hashed as it is read; a blob changed after the commit un-commits its checkpoint and the previous
    one is restored whole; nothing is left in the staging directory."""
    uri = "az://ckpts/restore-verify"
    settings = StorageSettings(connection_string=azurite.connection_string, staging_dir=str(tmp_path / "staging"),
                               download_chunk_mb=1)  # several ranges per shard even at this size

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 256)).sum().backward()
        opt.step()
        progress = Progress()
        return model, progress, {"model": ModelState(model, opt), "progress": progress}

    ctx = init({})
    first = None
    for step in (1, 2):
        model, progress, state = build(step)
        progress.step = step
        ck = Checkpointer(CheckpointConfig(uri=uri), ctx, state, settings=settings)
        ck.save(step)
        ck.close()
        first = first or [p.detach().clone() for p in model.parameters()]

    storage = CheckpointStorage(uri, settings)
    shard = max((n for n in storage.sizes("step-00000002") if n.endswith(".distcp")),
                key=lambda n: storage.sizes("step-00000002")[n])
    data = bytearray(storage.read_bytes(f"step-00000002/{shard}"))
    data[len(data) // 2] ^= 0xFF
    storage.fs.pipe_file(storage.path(f"step-00000002/{shard}"), bytes(data))  # same size: only a hash finds it

    model, progress, state = build(99)
    with caplog.at_level(logging.INFO, logger="azulite.train"):
        ck = Checkpointer(CheckpointConfig(uri=uri), ctx, state, settings=settings)
        assert ck.load_latest() == 1
    assert f"checkpoint step 2 is corrupt: file {shard} does not match the manifest" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(first, model.parameters())) and progress.step == 1
    assert storage.exists("step-00000002/manifest.corrupt.json")
    assert _staging_left(tmp_path / "staging") == []  # not even empty folders (step-N/, restore-step-N/)
