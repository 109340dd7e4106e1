"""The DDP example end to end: a real 2-rank job (torchrun, gloo) checkpoints to Azure Blob (Azurite);
``azulite export JOB_ID`` finds them, and their credentials, from the job and rebuilds its model from the
manifest alone; ``azulite serve`` answers Triton's clients over HTTP and gRPC
with what PyTorch computes from the job's own saved weights; a second export lands as version 2 and the
polling server picks it up without a restart; ``azulite config generate``'s config loads beside it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from azulite.workloads import mlp
from tests.cli.test_serve import Served
from tests.examples.runner import AZULITE, run_example
from tests.launch.jobkit import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a safety net: a real job trains first


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([AZULITE, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory, azurite) -> dict:
    """One finished DDP job on 1 node x 2 ranks, in its own AZULITE_HOME, checkpointing at steps 5, 10, 12
    to Azure Blob (Azurite): the job spec's outputs.checkpoints is az://, its credentials are in its
    environment_variables, and `azulite export JOB_ID` must find both from the job alone."""
    tmp = tmp_path_factory.mktemp("ddp_export")
    home = tmp / "azhome"
    mp = pytest.MonkeyPatch()
    mp.setenv("AZULITE_HOME", str(home))
    try:
        rec = run_example("ddp", "inputs.steps=12", "inputs.checkpoint_every=5", "resources.instance_count=1",
                          f"outputs.checkpoints.path=az://ddp-export/{tmp.name}",
                          f"environment_variables.AZURE_STORAGE_CONNECTION_STRING={azurite.connection_string}",
                          f"environment_variables.AZULITE_STAGING_DIR={tmp / 'staging'}")
    finally:
        mp.undo()
    rec["home"] = str(home)
    rec["checkpoints"] = f"az://ddp-export/{tmp.name}"
    return rec


def trained_model(rec: dict) -> torch.nn.Module:
    """The job's own final weights (rank 0 saves outputs/model/model.pt): independent of the checkpoint."""
    model = mlp.build_mlp(16, 32)
    model.load_state_dict(torch.load(Path(rec["job_dir"]) / "outputs" / "model" / "model.pt", weights_only=True))
    return model.eval()


def infer(client, module, model: str, name: str, out: str, x: np.ndarray, version: str = "") -> np.ndarray:
    i = module.InferInput(name, list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return client.infer(model, [i], model_version=version).as_numpy(out)


def test_export_job_serve_and_infer_equal_to_pytorch(ddp_job, tmp_path):
    env = {"AZULITE_HOME": ddp_job["home"]}
    repo = tmp_path / "repo"
    p = cli("export", ddp_job["id"], "--to", str(repo), "--json", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(p.stdout)
    assert (result["name"], result["version"], result["format"], result["step"]) == ("ddp", 1, "onnx", 12)
    assert result["verification"]["ok"] and result["verification"]["max_abs_error"] < 1e-5
    assert result["checkpoint"] == f"{ddp_job['checkpoints']}/step-00000012"

    # the same ONNX file under another name, with a config written offline by `config generate`
    (repo / "ddp_generated" / "1").mkdir(parents=True)
    shutil.copy(repo / "ddp" / "1" / "model.onnx", repo / "ddp_generated" / "1" / "model.onnx")
    p = cli("config", "generate", str(repo / "ddp_generated" / "1" / "model.onnx"), "--max-batch-size", "16",
            "--dynamic-batching", "-o", str(repo / "ddp_generated" / "config.pbtxt"))
    assert p.returncode == 0, p.stderr
    assert 'name: "ddp_generated"' in (repo / "ddp_generated" / "config.pbtxt").read_text()

    # the last-resort format: the factory and weights.pt in a Python-backend model.py
    p = cli("export", ddp_job["id"], "--to", str(repo), "--name", "ddp_py", "--format", "python", env=env)
    assert p.returncode == 0 and "as python" in p.stdout, p.stdout + p.stderr

    reference = trained_model(ddp_job)
    x = np.random.default_rng(5).standard_normal((7, 16)).astype(np.float32)
    want = reference(torch.from_numpy(x)).detach().numpy()
    s = Served(str(repo), "--model-control-mode", "poll", "--repository-poll-secs", "1")
    try:
        h = httpclient.InferenceServerClient(f"127.0.0.1:{s.ports['HTTPService']}")
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{s.ports['GRPCInferenceService']}")
        try:
            for module, client in ((httpclient, h), (grpcclient, g)):
                for model in ("ddp", "ddp_generated", "ddp_py"):
                    got = infer(client, module, model, "x", "y", x)
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
            # a new version through the export (the model's format: tests/export/test_pipeline.py shows another
            # one refused), picked up by the polling server without a restart
            p = cli("export", ddp_job["id"], "--to", str(repo), "--step", "10", env=env)
            assert p.returncode == 0, p.stdout + p.stderr
            assert "version 2" in p.stdout and "as onnx" in p.stdout
            deadline = time.monotonic() + 120  # a safety net: the condition is the server's readiness
            while not h.is_model_ready("ddp", "2") and time.monotonic() < deadline:
                time.sleep(0.2)
            assert h.is_model_ready("ddp", "2")
            step10 = infer(g, grpcclient, "ddp", "x", "y", x, version="2")
            assert step10.shape == want.shape and not np.allclose(step10, want)  # step 10, not the final step 12
            np.testing.assert_allclose(infer(h, httpclient, "ddp", "x", "y", x), step10, rtol=1e-6)
        finally:
            h.close()
            g.close()
    finally:
        s.stop()


def test_cli_errors_are_messages_not_tracebacks(ddp_job, tmp_path):
    repo = tmp_path / "repo"
    p = cli("export", "nosuch-1", "--to", str(repo), env={"AZULITE_HOME": ddp_job["home"]})
    assert p.returncode == 2 and "no job 'nosuch-1'" in p.stderr and "Traceback" not in p.stderr, p.stderr
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx file")
    p = cli("config", "generate", str(bad))
    assert p.returncode == 2 and "cannot read" in p.stderr and "as an ONNX model" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    p = cli("export", ddp_job["id"], "--to", str(repo), "--format", "tflite", env={"AZULITE_HOME": ddp_job["home"]})
    assert p.returncode == 2 and "unknown format 'tflite'" in p.stderr, p.stderr
    assert not repo.exists() or not any(repo.iterdir())
