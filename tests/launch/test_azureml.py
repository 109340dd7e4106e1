"""The ``azureml`` backend through azure-ai-ml's MLClient against a local HTTPS workspace that answers the
SDK's calls (management, run history, a managed-identity token), keeps code and logs on Azurite, and refuses
bodies failing the Azure ML REST definitions (tests/launch/aml_api.py says what is not exercised)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from azulite.errors import AzuliteError, DeployError, LaunchError
from azulite.launch.records import JobState
from azulite.launch.settings import Settings
from azulite.spec.loader import load_job

pytest.importorskip("azure.ai.ml")

from azulite.launch.azureml import AzureMLBackend  # noqa: E402
from tests.launch.aml_api import FakeAzureML  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKSPACE = {"AZULITE_AML_SUBSCRIPTION": "sub", "AZULITE_AML_RESOURCE_GROUP": "rg", "AZULITE_AML_WORKSPACE": "ws"}


class StaticToken:
    """Stands in for Entra ID (none runs here): the bearer token the local endpoint expects."""

    def get_token(self, *scopes, **kwargs):
        from azure.core.credentials import AccessToken

        return AccessToken(FakeAzureML.TOKEN, int(time.time()) + 3600)


@pytest.fixture
def aml(tmp_path, monkeypatch):
    with FakeAzureML(tmp_path) as fake:
        monkeypatch.setenv("AZUREML_DEV_URL_MFE", fake.url)  # azure-ai-ml's own endpoint override
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(fake.cert))
        yield fake
        assert fake.errors == [], fake.errors


def backend(tmp_path, credential=None, **env):
    settings = Settings.from_environ({"AZULITE_HOME": str(tmp_path / "home")})
    return AzureMLBackend(settings, {**WORKSPACE, **env}, credential=credential or StaticToken())


def test_submit_status_cancel(tmp_path, aml):
    b = backend(tmp_path)
    rec = b.submit(load_job(ROOT / "examples/azureml/arr-coc/job.yaml"))
    assert rec.backend == "azureml" and rec.state == JobState.QUEUED
    ((name, job),) = aml.jobs.items()
    props = job["properties"]
    assert props["jobType"] == "Command" and props["distribution"] == {"distributionType": "PyTorch", "processCountPerInstance": 4}
    assert props["resources"]["instanceCount"] == 2 and props["resources"]["instanceType"] == "Standard_NC24rs_v3"
    assert props["computeId"].endswith("/computes/gpu-cluster")
    assert json.loads((Path(rec.job_dir) / "remote.json").read_text())["name"] == name

    aml.set_status(name, "Running")
    assert b.status(rec.id).state == JobState.RUNNING
    assert list(b.logs(rec.id)) == []  # the run has written no log file yet
    with pytest.raises(LaunchError, match="cannot preempt") as e:
        b.preempt(rec.id)
    assert e.value.where == "job preempt" and "--backend local|kubernetes" in e.value.fix
    assert b.cancel(rec.id).state == JobState.CANCELED
    assert aml.jobs[name]["properties"]["status"] == "CancelRequested"
    assert ("POST", f"/subscriptions/sub/resourceGroups/rg/providers/Microsoft.MachineLearningServices/workspaces/ws/jobs/{name}/cancel") in aml.requests


def test_spot_job_with_inputs_outputs_and_limits(tmp_path, aml):
    (tmp_path / "code").mkdir()
    spec = {"name": "dlrm", "code": "code", "command": "python train.py --steps ${{inputs.steps}} --out ${{outputs.checkpoints}}",
            "inputs": {"steps": 40}, "outputs": {"checkpoints": {"path": "az://ckpt/dlrm"}},
            "environment": "azureml:AzureML-acpt-pytorch-2.2-cuda12.1@latest", "compute": "gpu-cluster", "priority": "spot",
            "timeout": "2h", "resources": {"instance_type": "Standard_ND96asr_v4", "instance_count": 2},
            "distribution": {"type": "pytorch", "process_count_per_instance": 8}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    b = backend(tmp_path, AZULITE_AML_DATASTORE="ckptstore")
    rec = b.submit(load_job(tmp_path / "job.yaml"))
    ((name, job),) = aml.jobs.items()
    props = job["properties"]
    assert props["queueSettings"] == {"jobTier": "Spot"}
    assert props["limits"]["timeout"] == "PT2H"
    assert props["inputs"]["steps"] == {"jobInputType": "literal", "value": "40"}
    assert props["outputs"]["checkpoints"]["uri"] == "azureml://datastores/ckptstore/paths/dlrm"
    aml.set_status(name, "Completed")
    assert b.status(rec.id).state == JobState.SUCCEEDED


def test_the_endpoint_refuses_bodies_that_fail_the_rest_spec(tmp_path, aml):
    import requests

    url = (f"{aml.url}/subscriptions/sub/resourceGroups/rg/providers/Microsoft.MachineLearningServices/workspaces/ws"
           "/jobs/j1?api-version=2025-01-01-preview")
    body = {"properties": {"jobType": "Command", "command": "python train.py", "environmentId": "azureml:env:1",
                           "distribution": {"distributionType": "Pytorch"}, "resources": {"instanceCount": "2"}}}
    r = requests.put(url, json=body, headers={"Authorization": f"Bearer {FakeAzureML.TOKEN}"}, verify=str(aml.cert), timeout=30)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "'Pytorch' names no subtype" in message and "instanceCount: expected integer" in message
    assert aml.jobs == {}


def test_absent_credentials_are_refused_before_anything_is_sent(tmp_path, aml, monkeypatch):
    from azure.identity import EnvironmentCredential

    for var in ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET", "AZURE_USERNAME", "AZURE_CLIENT_CERTIFICATE_PATH"):
        monkeypatch.delenv(var, raising=False)
    b = backend(tmp_path, credential=EnvironmentCredential())
    with pytest.raises(DeployError) as e:
        b.submit(load_job(ROOT / "examples/azureml/arr-coc/job.yaml"))
    assert e.value.where == "Azure credentials" and "az login" in e.value.fix
    assert aml.requests == [] and b.list() == []


def test_missing_workspace_settings_and_bad_specs(tmp_path, aml):
    settings = Settings.from_environ({"AZULITE_HOME": str(tmp_path / "home")})
    b = AzureMLBackend(settings, {"AZULITE_AML_SUBSCRIPTION": "sub"}, credential=StaticToken())
    with pytest.raises(DeployError) as e:
        b.submit(load_job(ROOT / "examples/azureml/arr-coc/job.yaml"))
    assert e.value.where == "AZULITE_AML_RESOURCE_GROUP"
    import shutil

    shutil.copytree(ROOT / "examples/azureml/arr-coc", tmp_path / "arr-coc")
    job = tmp_path / "arr-coc" / "job.yaml"
    job.write_text(job.read_text().replace("compute: azureml:gpu-cluster\n", ""))
    with pytest.raises(DeployError) as e:  # the render's fix named --compute, which job submit does not have
        backend(tmp_path).submit(load_job(job))
    assert "set AZULITE_AML_COMPUTE=gpu-cluster" in e.value.fix and "--compute" not in str(e.value)
    with pytest.raises(AzuliteError, match="has 4 GPU"):
        backend(tmp_path).submit(load_job(ROOT / "examples/azureml/arr-coc/job.yaml",
                                          ["distribution.process_count_per_instance=8"]))
    assert aml.requests == []


# ---- inline environment, code upload and logs, end to end through the CLI ----------------------------
IMAGE = "mcr.microsoft.com/azureml/openmpi4.1.0-ubuntu22.04"
P0, P1 = "user_logs/std_log_process_0.txt", "user_logs/std_log_process_1.txt"


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    from tests.train.azurite import running

    with running(tmp_path_factory) as az:
        yield az


@pytest.fixture
def workspace(tmp_path, monkeypatch, azurite):
    """The stand-in with Azurite as its Blob store, and the shell of a user who can reach it: the CLI builds
    its own backend and DefaultAzureCredential (here a managed identity served by the stand-in)."""
    with FakeAzureML(tmp_path, azurite) as fake:
        for var in ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET", "AZURE_USERNAME",
                    "AZURE_FEDERATED_TOKEN_FILE", "AZULITE_BACKEND", "IMDS_ENDPOINT", "IDENTITY_SERVER_THUMBPRINT"):
            monkeypatch.delenv(var, raising=False)
        env = {**fake.environ(), **WORKSPACE, "AZULITE_HOME": str(tmp_path / "home"), "AZULITE_AML_POLL_S": "0.01"}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        yield fake
        assert fake.errors == [], fake.errors


def cli(*args: str) -> str:
    """``azulite ARGS`` in this process (the SDK takes seconds to import); a safety net, not a timing: a
    `--follow` that never ends fails here instead of hanging the suite."""
    from typer.testing import CliRunner

    from azulite.cli import app

    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=CliRunner().invoke(app, list(args))), daemon=True)
    t.start()
    t.join(timeout=240)
    assert not t.is_alive(), f"azulite {' '.join(args)} did not end"
    r = box["r"]
    assert r.exit_code == 0, (r.output, r.exception)
    return r.stdout


def test_inline_environment_and_local_code_then_logs_and_follow_through_the_cli(tmp_path, workspace):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('epoch')\n")
    (tmp_path / "conda.yml").write_text("name: train\ndependencies: [python=3.11, pip, {pip: [numpy]}]\n")
    spec = {"name": "mnist", "code": "code", "command": "python train.py", "compute": "gpu-cluster",
            "environment": {"image": IMAGE, "conda_file": "conda.yml"},
            "resources": {"instance_type": "Standard_NC24rs_v3", "instance_count": 1},
            "distribution": {"type": "pytorch", "process_count_per_instance": 2}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    rec = json.loads(cli("job", "submit", str(tmp_path / "job.yaml"), "--backend", "azureml", "--json"))
    assert ("GET", "/msi/token") in workspace.requests  # the CLI's own DefaultAzureCredential signed in

    # the SDK registered the inline environment as an anonymous version and the job refers to it
    ((name, job),) = workspace.jobs.items()
    ((env_name, env_version), env) = next(iter(workspace.environments.items()))
    assert env_name == "CliV2AnonymousEnvironment" and env["properties"]["image"] == IMAGE
    assert "numpy" in env["properties"]["condaFile"]
    assert job["properties"]["environmentId"].endswith(f"/environments/{env_name}/versions/{env_version}")
    # the code went to the Blob store through the pending upload's SAS, then was registered by its hash
    ((code_name, code_version), code) = next(iter(workspace.codes.items()))
    assert job["properties"]["codeId"].endswith(f"/codes/{code_name}/versions/{code_version}")
    (container,) = workspace.uploads
    assert code["properties"]["codeUri"].startswith(workspace._blob_url(container))
    blobs = {b.name: b for b in workspace._blob().get_container_client(container).list_blobs()}
    (train,) = [b for b in blobs if b.endswith("/train.py")]
    assert workspace._blob().get_blob_client(container, train).download_blob().readall() == b"print('epoch')\n"
    # the same code again is found by its hash: nothing uploaded twice
    cli("job", "submit", str(tmp_path / "job.yaml"), "--backend", "azureml", "--json")
    assert len(workspace.uploads) == 1 and len(workspace.codes) == 1 and len(workspace.jobs) == 2

    # the stand-in "runs" the job: each run-details poll moves it on and appends to its log blobs
    workspace.script(name, [
        ("Running", {P0: "epoch 1 loss 0.9\n", P1: "epoch 1 loss 0.8\n"}),
        ("Running", {P0: "epoch 2 loss 0.5\nepoch 3 lo"}),  # a line still being written
        ("Completed", {P0: "ss 0.3\n", P1: "epoch 3 loss 0.4\n"}),
    ])
    assert cli("job", "logs", rec["id"]).splitlines() == [
        "[std_log_process_0] epoch 1 loss 0.9", "[std_log_process_1] epoch 1 loss 0.8"]
    assert json.loads(cli("job", "show", rec["id"], "--json"))["state"] == "running"
    assert cli("job", "logs", rec["id"], "--follow").splitlines() == [
        "[std_log_process_0] epoch 1 loss 0.9", "[std_log_process_0] epoch 2 loss 0.5",
        "[std_log_process_1] epoch 1 loss 0.8",
        "[std_log_process_0] epoch 3 loss 0.3", "[std_log_process_1] epoch 3 loss 0.4"]
    assert json.loads(cli("job", "show", rec["id"], "--json"))["state"] == "succeeded"
    assert cli("job", "logs", rec["id"], "--rank", "1").splitlines() == [
        "[std_log_process_1] epoch 1 loss 0.8", "[std_log_process_1] epoch 3 loss 0.4"]
    details = f"/history/v1.0/subscriptions/sub/resourceGroups/rg/providers/Microsoft.MachineLearningServices/workspaces/ws/runs/{name}/details"
    assert workspace.requests.count(("GET", details)) == 4  # 1 (logs) + 2 (follow: until Completed) + 1 (--rank)


def test_the_workspace_refuses_environment_and_upload_bodies_that_fail_the_models(tmp_path, workspace):
    import requests

    base = (f"{workspace.url}/subscriptions/sub/resourceGroups/rg/providers/Microsoft.MachineLearningServices/workspaces/ws")
    auth = {"Authorization": f"Bearer {FakeAzureML.TOKEN}"}
    r = requests.put(f"{base}/environments/e/versions/1?api-version=2023-04-01-preview", headers=auth,
                     json={"properties": {"imge": IMAGE, "isAnonymous": "yes"}}, verify=str(workspace.cert), timeout=30)
    assert r.status_code == 400
    assert "properties.imge: not a property of EnvironmentVersionProperties" in r.json()["error"]["message"]
    assert "properties.isAnonymous: expected bool" in r.json()["error"]["message"]
    r = requests.post(f"{base}/codes/c/versions/1/startPendingUpload?api-version=2023-04-01", headers=auth,
                      json={"pendingUploadType": "TemporaryBlobReference", "pendingUploadId": 7}, verify=str(workspace.cert), timeout=30)
    assert r.status_code == 400 and "pendingUploadId: expected str" in r.json()["error"]["message"]
    assert workspace.environments == {} and workspace.uploads == []


# definitions of the REST excerpt written from the spec rather than copied (data/azureml-rest/README.md)
HAND_WRITTEN = ("DistributionConfiguration", "DistributionType", "Mpi", "TensorFlow", "OutputDeliveryMode",
                "IdentityConfiguration", "AmlToken", "ManagedIdentity", "UserIdentity", "NotificationSetting",
                "AssetBase", "ProxyResource")


@pytest.mark.parametrize("name", HAND_WRITTEN)
def test_hand_written_definitions_agree_with_the_sdks_generated_models(name):
    """azure-ai-ml's generated ARM models come from an older api-version of the same REST definitions: all
    they know must be in the excerpt (properties, required ones, enum values, subtypes), so a definition
    misremembered when it was written fails here."""
    import typing

    from tests.launch.aml_api import DEFS, _flatten, _subtype
    from tests.launch.aml_models import _fields, arm

    model = getattr(arm().models, name)
    d = DEFS[name]
    if "enum" in d:
        assert {m.value for m in model} <= set(d["enum"])
        return
    props, required, _ = _flatten(name)
    fields = _fields(model)
    assert set(fields) <= set(props)
    assert required == {r for r, (_, note, vis, _) in fields.items()
                        if type(None) not in typing.get_args(note) and "create" in vis}
    for value in model.__dict__.get("__mapping__") or {}:
        assert _subtype(name, value) is not None, f"{name}: the SDK knows subtype {value!r}"


# ---- logs listed from the job's default-output datastore, as jobs.stream does ------------------------
@pytest.fixture(scope="module")
def tls_azurite(tmp_path_factory):
    """An Azurite serving TLS with the stand-in's certificate (for the datastore's https://ACCOUNT.blob.core.windows.net
    URLs, reached through blob_tunnel.py)."""
    from tests.launch.aml_api import self_signed_cert
    from tests.train.azurite import Azurite, azurite_binary

    if azurite_binary() is None:
        pytest.skip("azurite not installed (scripts/install.sh --dev)")
    certs = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_cert(certs)
    az = Azurite(tmp_path_factory.mktemp("azurite-tls"), args=("--cert", str(cert), "--key", str(key))).start()
    az.cert = (cert, key)
    try:
        yield az
    finally:
        az.stop()


def test_logs_listed_from_the_default_output_datastore(tmp_path, monkeypatch, tls_azurite):
    from tests.launch.aml_api import BLOB_HOST
    from tests.launch.blob_tunnel import BlobTunnel

    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tls_azurite.cert[0]))
    with BlobTunnel(tls_azurite.port) as tunnel, \
            FakeAzureML(tmp_path, tls_azurite, default_output=True, cert=tls_azurite.cert) as fake:
        monkeypatch.setenv("AZUREML_DEV_URL_MFE", fake.url)
        monkeypatch.setenv("HTTPS_PROXY", tunnel.url)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        b = backend(tmp_path, AZULITE_AML_POLL_S="0.01")
        rec = b.submit(load_job(ROOT / "examples/azureml/arr-coc/job.yaml"))
        ((name, job),) = fake.jobs.items()
        assert job["properties"]["outputs"]["default"]["uri"].endswith(f"/ExperimentRun/dcid.{name}")
        fake.script(name, [("Running", {P0: "step 1\n"}), ("Completed", {P0: "step 2\n", P1: "step 2 on rank 1\n"})])
        assert list(b.logs(rec.id, follow=True)) == [
            "[std_log_process_0] step 1", "[std_log_process_0] step 2", "[std_log_process_1] step 2 on rank 1"]
        assert b.status(rec.id).state == JobState.SUCCEEDED
        assert set(tunnel.hosts) == {BLOB_HOST}  # listing and reading went to the datastore's Blob host
        ws = "/subscriptions/sub/resourceGroups/rg/providers/Microsoft.MachineLearningServices/workspaces/ws"
        assert ("POST", f"{ws}/datastores/workspaceartifactstore/listSecrets") in fake.requests
        assert fake.errors == [], fake.errors


def test_submit_refuses_what_render_refuses_in_the_same_words(tmp_path, aml):
    """The backend refused max_restarts ("the azureml backend does not support: max_restarts", fix: "drop the
    feature") while render dropped it, and both dropped elastic."""
    from azulite.deploy.azureml import AzureMLOptions
    from azulite.deploy.options import AksOptions
    from azulite.deploy.render import render_spec

    spec = ROOT / "examples/azureml/arr-coc/job.yaml"
    for sets, where in ((["max_restarts=2"], "max_restarts"), (["elastic.min_nodes=1"], "elastic")):
        with pytest.raises(DeployError) as submitted:
            backend(tmp_path).submit(load_job(spec, sets))
        with pytest.raises(DeployError) as rendered:
            render_spec(spec, "azureml", AksOptions(), AzureMLOptions(), overrides=sets)
        assert str(submitted.value) == str(rendered.value) and submitted.value.where == where
        assert f"--set {where}=" in submitted.value.fix
    assert aml.requests == []


def test_a_bad_storage_account_setting_is_refused(tmp_path, aml):
    with pytest.raises(DeployError) as e:
        backend(tmp_path, AZULITE_AML_STORAGE_ACCOUNT="My_Account")
    assert e.value.where == "AZULITE_AML_STORAGE_ACCOUNT" and "3 to 24 lowercase letters and digits" in e.value.fix
    assert aml.requests == []
