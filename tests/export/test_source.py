"""Export from a checkpoint location on Azure Blob (``az://``), against a real Azurite: the command line
exports the newest committed step and the served file equals the saved model; a blob whose bytes differ
from the manifest, or that is gone, is refused by name, with nothing written into the repository."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import onnxruntime as ort
import pytest
import torch
from azure.storage.blob import BlobServiceClient

from azulite.errors import CheckpointError
from azulite.export import ExportOptions, export_checkpoint
from azulite.workloads import mlp
from tests.examples.runner import AZULITE
from tests.export.conftest import repo_entries, save_checkpoint
from tests.launch.jobkit import REPO

CONTAINER = "exports"


@pytest.fixture
def blob_env(azurite, tmp_path) -> dict[str, str]:
    return {"AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string, "AZULITE_STORAGE_RETRIES": "1",
            "AZULITE_STAGING_DIR": str(tmp_path / "staging")}


def test_export_from_blob_and_a_damaged_blob_is_refused_by_name(azurite, blob_env, tmp_path):
    prefix = "mlp"  # the Azurite is this session's own
    uri = f"az://{CONTAINER}/{prefix}"
    torch.manual_seed(3)
    old = mlp.build_mlp(8, 16)
    save_checkpoint(uri, old, mlp.model_config(8, 16), step=5, environ=blob_env)
    model = mlp.build_mlp(8, 16)
    save_checkpoint(uri, model, mlp.model_config(8, 16), step=7, environ=blob_env)

    repo = tmp_path / "repo"
    p = subprocess.run([AZULITE, "export", uri, "--to", str(repo), "--name", "m", "--json"], capture_output=True,
                       text=True, timeout=300, cwd=REPO, env={**os.environ, **blob_env, "COLUMNS": "200"})
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(p.stdout)
    assert (result["checkpoint"], result["step"], result["format"]) == (f"{uri}/step-00000007", 7, "onnx")
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    got = ort.InferenceSession(str(repo / "m" / "1" / "model.onnx")).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(got, model(torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-5)
    before = repo_entries(repo)

    # one shard's bytes changed on Blob (same length): refused by its name, nothing written
    container = BlobServiceClient.from_connection_string(azurite.connection_string).get_container_client(CONTAINER)
    shard = sorted(b.name for b in container.list_blobs(name_starts_with=f"{prefix}/step-00000007/")
                   if b.name.endswith(".distcp"))[0]
    data = bytearray(container.download_blob(shard).readall())
    data[len(data) // 2] ^= 0xFF
    container.upload_blob(shard, bytes(data), overwrite=True)
    name = shard.rsplit("/", 1)[1]
    with pytest.raises(CheckpointError) as err:
        export_checkpoint(uri, ExportOptions(repo=repo, name="m"), environ=blob_env)
    assert f"file {name} does not match the manifest" in err.value.message
    assert err.value.where == f"{uri}/step-00000007" and "--step" in err.value.fix
    # gone altogether
    container.delete_blob(shard)
    with pytest.raises(CheckpointError, match=rf"file {name} listed in the manifest is missing"):
        export_checkpoint(f"{uri}/step-00000007", ExportOptions(repo=repo, name="m"), environ=blob_env)
    assert repo_entries(repo) == before
    # the older step is intact and exports, as asked (never silently instead of the damaged one)
    result = export_checkpoint(uri, ExportOptions(repo=repo, name="m", step=5), environ=blob_env)
    assert (result.step, result.version) == (5, 2)
    got = ort.InferenceSession(str(repo / "m" / "2" / "model.onnx")).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(got, old(torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_credentials_the_account_refuses_are_the_users_to_fix_not_storage_down(azurite, blob_env, tmp_path):
    from azulite.errors import StorageConfigError

    wrong = azurite.connection_string.replace("AccountKey=", "AccountKey=AAAA", 1)
    with pytest.raises(StorageConfigError, match="refused the credentials for az://exports/mlp") as e:
        export_checkpoint(f"az://{CONTAINER}/mlp", ExportOptions(repo=tmp_path / "repo"),
                          environ={**blob_env, "AZURE_STORAGE_CONNECTION_STRING": wrong})
    assert e.value.exit_code == 2 and "AZURE_STORAGE_ACCOUNT_KEY" in e.value.fix  # was "cannot read", exit 1
    assert not (tmp_path / "repo").exists()


def test_a_step_folder_under_another_name_says_how_it_must_be_named(tmp_path):
    # a good step folder renamed (bad/s1) read as "no committed checkpoint under ... (no step directories)"
    from azulite.errors import ExportError
    from azulite.export.source import resolve

    step = save_checkpoint(tmp_path / "ckpt", mlp.build_mlp(), mlp.model_config(), step=40)
    renamed = tmp_path / "bad" / "s1"
    renamed.parent.mkdir()
    step.rename(renamed)
    with pytest.raises(ExportError) as e:
        resolve(str(renamed))
    assert e.value.exit_code == 2 and e.value.where == str(renamed)
    assert e.value.message == ("this folder holds a manifest.json but is not a checkpoint step folder: 's1' is not "
                               "named step-NNNNNNNN (and it holds no step folders)")
    assert e.value.fix.startswith("rename the folder step-00000040 ")
    renamed.rename(renamed.parent / "step-00000040")
    assert resolve(str(renamed.parent / "step-00000040")).step == 40
