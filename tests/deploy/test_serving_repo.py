"""The model repository a serving pod on AKS is given: only what its server reads from inside the pod, with the
credentials wired (deploy/serving_repo.py). Each refused case rendered before: a workstation path with no
volume, azureml:// and az:// URIs handed to Triton, which reads neither."""

from __future__ import annotations

import pytest

from azulite.errors import AzuliteError
from tests.deploy.test_serving import AKS, render, spec_file
from tests.deploy.test_training import assert_valid, the

KEY_REF = {"secretKeyRef": {"name": "models-storage", "key": "azurestorageaccountkey"}}


def container(objects: list[dict]) -> dict:
    return the(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


@pytest.mark.parametrize("server, image", [("triton", None), ("azulite", "reg.io/serve:1")])
@pytest.mark.parametrize("repo", ["./model_repository", "/srv/models", "model_repository"])
def test_a_local_repository_is_refused_for_aks(tmp_path, server, image, repo):
    """It became --model-repository=/tmp/.../model_repository: this machine's path, in a pod with no volume."""
    (tmp_path / "model_repository").mkdir()
    p = spec_file(tmp_path, server=server, image=image, model_repository=repo)
    with pytest.raises(AzuliteError) as e:
        render(p, storage_account="acct", storage_key_secret="models-storage")
    line = next(i for i, text in enumerate(p.read_text().splitlines(), 1) if text.startswith("model_repository:"))
    assert e.value.where == f"{p}:{line} (model_repository)", e.value.where
    assert "a pod on AKS cannot see it" in e.value.message and "az://CONTAINER/PATH" in e.value.fix


@pytest.mark.parametrize("server, image", [("triton", None), ("azulite", "reg.io/serve:1")])
def test_an_azure_ml_asset_is_refused_for_aks(tmp_path, server, image):
    """The shipped example handed Triton --model-repository=azureml://models/arr-coc-ensemble."""
    p = spec_file(tmp_path, server=server, image=image, model_repository="azureml://models/arr-coc-ensemble")
    with pytest.raises(AzuliteError) as e:
        render(p, storage_account="acct", storage_key_secret="models-storage")
    assert "model_repository" in e.value.where and "Azure ML model asset" in e.value.message
    assert "--target azureml" in e.value.fix


def test_triton_gets_az_uris_as_azure_storage_uris_with_the_key_from_a_secret(tmp_path):
    p = spec_file(tmp_path, model_repository="az://models/x")
    with pytest.raises(AzuliteError) as e:  # which account: Triton's URI names it
        render(p)
    assert "does not say which account" in e.value.message and "--storage-account" in e.value.fix
    with pytest.raises(AzuliteError) as e:  # no credential Triton 24.01 can use
        render(p, storage_account="acct")
    assert "Triton needs the storage account's key" in e.value.message and "--storage-key-secret" in e.value.fix
    objects = render(p, storage_account="acct", storage_key_secret="models-storage")
    assert_valid(objects)
    c = container(objects)
    assert c["args"][0] == "--model-repository=as://acct/models/x"
    assert env_of(c)["AZURE_STORAGE_KEY"] == KEY_REF
    # the account may come from the spec's environment, the key too (the user's word wins)
    c = container(render(spec_file(tmp_path, model_repository="az://models/x",
                                   environment_variables={"AZURE_STORAGE_ACCOUNT": "acct2", "AZURE_STORAGE_KEY": "k"})))
    assert c["args"][0] == "--model-repository=as://acct2/models/x" and env_of(c)["AZURE_STORAGE_KEY"] == "k"


@pytest.mark.parametrize("repo, given", [
    ("as://acct/models/x", "as://acct/models/x"),
    ("as://acct.blob.core.windows.net/models/x", "as://acct.blob.core.windows.net/models/x"),
    ("s3://bucket/models", "s3://bucket/models"),
    ("gs://bucket/models", "gs://bucket/models"),
])
def test_uris_triton_reads_itself_pass_through(tmp_path, repo, given):
    c = container(render(spec_file(tmp_path, model_repository=repo), storage_key_secret="models-storage"))
    assert c["args"][0] == f"--model-repository={given}"
    assert ("AZURE_STORAGE_KEY" in env_of(c)) == repo.startswith("as://")


@pytest.mark.parametrize("repo, said", [
    ("https://acct.blob.core.windows.net/models/x", "Triton cannot read https://"),
    ("as://acct", "not an Azure Storage URI"),
    ("az:///x", "names no Blob container"),
])
def test_uris_triton_cannot_read_are_refused(tmp_path, repo, said):
    with pytest.raises(AzuliteError) as e:
        render(spec_file(tmp_path, model_repository=repo), storage_account="acct", storage_key_secret="s")
    assert said in e.value.message and "model_repository" in e.value.where


def test_azulite_serve_reads_blob_through_workload_identity_or_a_key_secret(tmp_path):
    base = dict(base="gpu-workload.yaml", environment_variables=None)
    p = spec_file(tmp_path, **base)
    with pytest.raises(AzuliteError) as e:
        render(p)
    assert "needs its storage account" in e.value.message and "--storage-account" in e.value.fix
    objects = render(p, storage_account="acct")
    assert_valid(objects)
    dep = the(objects, "Deployment")
    pod, c = dep["spec"]["template"]["spec"], container(objects)
    assert env_of(c)["AZURE_STORAGE_ACCOUNT_NAME"] == "acct" and pod["serviceAccountName"] == "azulite"
    assert dep["spec"]["template"]["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    # its mirror lives on an emptyDir (kept across container restarts), whatever the image's user may write
    assert env_of(c)["AZULITE_MODEL_CACHE"] == "/var/cache/azulite/model-cache"
    assert pod["volumes"] == [{"name": "model-cache", "emptyDir": {}}]
    objects = render(p, storage_account="acct", storage_key_secret="models-storage")
    pod, c = the(objects, "Deployment")["spec"]["template"]["spec"], container(objects)
    assert env_of(c)["AZURE_STORAGE_ACCOUNT_KEY"] == KEY_REF and "serviceAccountName" not in pod
    # a connection string in the spec needs nothing more
    c = container(render(spec_file(tmp_path, base="gpu-workload.yaml",
                                   environment_variables={"AZURE_STORAGE_CONNECTION_STRING": "cs"})))
    assert "AZURE_STORAGE_ACCOUNT_NAME" not in env_of(c)


def test_azulite_serve_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(AzuliteError) as e:
        render(spec_file(tmp_path, base="gpu-workload.yaml", model_repository="as://acct/models/x"))
    assert "azulite serve cannot read as:// repositories" in e.value.message and "server: triton" in e.value.fix


def test_the_shipped_examples_render_as_their_comments_say():
    assert_valid(render(AKS / "arr-coc-triton.yaml", storage_account="mystorageaccount",
                        storage_key_secret="models-storage"))
    assert_valid(render(AKS / "gpu-workload.yaml"))
