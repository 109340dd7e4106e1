"""The ``azureml`` backend through azure-ai-ml's MLClient against a local HTTPS endpoint that answers the
SDK's calls and refuses bodies failing the Azure ML REST spec (tests/launch/aml_api.py says what is not
exercised)."""

from __future__ import annotations

import json
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
    with pytest.raises(LaunchError, match="az ml job stream"):
        list(b.logs(rec.id))
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
    with pytest.raises(AzuliteError, match="has 4 GPU"):
        backend(tmp_path).submit(load_job(ROOT / "examples/azureml/arr-coc/job.yaml",
                                          ["distribution.process_count_per_instance=8"]))
    assert aml.requests == []
