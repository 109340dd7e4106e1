"""The server and the repository manifest: a model with a tampered, missing or unlisted file is refused
and named while the other models serve; a broken manifest or signature stops the start with the file
named; file overrides through the load API are refused when the repository is verified."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from azulite import integrity
from azulite.errors import IntegrityError
from azulite.serve.server import Server, ServerSettings

from .conftest import build_model_repository
from .frontends import running_server

MODELS = ("add_sub_onnx", "add_sub_py", "string_py")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return build_model_repository(tmp_path_factory.mktemp("integrity_repo"), MODELS)


@pytest.fixture
def repo(tmp_path, pristine):
    root = tmp_path / "repo"
    shutil.copytree(pristine, root)
    return root


def _infer_py(client) -> np.ndarray:
    x = np.ones((1, 16), dtype=np.float32)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        i = httpclient.InferInput(name, [1, 16], "FP32")
        i.set_data_from_numpy(x)
        inputs.append(i)
    return client.infer("add_sub_py", inputs).as_numpy("OUTPUT0")


def test_tampered_models_are_refused_and_named_while_others_serve(repo):
    integrity.sign_repository(repo)
    (repo / "add_sub_onnx" / "1" / "model.onnx").write_bytes(b"\x08\x07tampered")
    (repo / "string_py" / "1" / "backdoor.py").write_text("import os\n")
    with running_server(repo) as s:  # no --verify: a manifest in the repository is always honoured
        client = httpclient.InferenceServerClient(s.http_url)
        try:
            np.testing.assert_array_equal(_infer_py(client), np.full((1, 16), 2.0, dtype=np.float32))
            index = {m["name"]: m for m in client.get_model_repository_index()}
            assert index["add_sub_py"]["state"] == "READY"
            assert index["add_sub_onnx"]["state"] == "UNAVAILABLE"
            assert "add_sub_onnx/1/model.onnx" in index["add_sub_onnx"]["reason"]
            assert "sha256" in index["add_sub_onnx"]["reason"]
            assert "string_py/1/backdoor.py' is not in the manifest" in index["string_py"]["reason"]
            assert not client.is_model_ready("add_sub_onnx")
        finally:
            client.close()


def test_verify_flag_needs_a_manifest_and_bad_ones_stop_the_start(repo, tmp_path):
    import asyncio

    def start(**kw):
        server = Server(ServerSettings(repository=repo, http_port=-1, grpc_port=-1, metrics_port=-1, **kw))
        asyncio.run(server.start())
        asyncio.run(server.stop(0))

    with pytest.raises(IntegrityError, match="no azulite-manifest.json"):
        start(verify=True)
    private, public = tmp_path / "k.pem", tmp_path / "k.pub.pem"
    integrity.generate_keypair(private, public)
    integrity.sign_repository(repo, private)
    with pytest.raises(IntegrityError, match="no public key"):
        start()
    other_private, other_public = tmp_path / "o.pem", tmp_path / "o.pub.pem"
    integrity.generate_keypair(other_private, other_public)
    with pytest.raises(IntegrityError, match="azulite-manifest.sig"):
        start(manifest_key=other_public)
    start(manifest_key=public)  # the right key: starts
    (repo / integrity.MANIFEST).write_text("{")
    with pytest.raises(IntegrityError, match="not valid JSON"):
        start(manifest_key=public)


@pytest.mark.parametrize("where", ["../../outside/model.py", "{outside}/model.py"])
def test_a_config_override_cannot_point_a_model_at_code_outside_it(repo, tmp_path, where):
    """default_model_filename in a load API config override named a model.py elsewhere, which the manifest
    never covers: it ran (found by a user-testing pass). Refused, naming the field, the code never read."""
    integrity.sign_repository(repo)
    outside = tmp_path / "outside"
    outside.mkdir()
    marker = tmp_path / "ran"
    (outside / "model.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    with running_server(repo, model_control_mode="explicit", load_models=("add_sub_py",)) as s:
        client = httpclient.InferenceServerClient(s.http_url)
        try:
            config = json.loads(json.dumps(client.get_model_config("add_sub_py")))
            config["default_model_filename"] = where.format(outside=outside)
            with pytest.raises(InferenceServerException, match="default_model_filename .* must name a file inside"):
                client.load_model("add_sub_py", config=json.dumps(config))
            assert (_infer_py(client) == 2).all()  # the loaded model serves on, unchanged
        finally:
            client.close()
    assert not marker.exists()


def test_file_overrides_are_refused_in_a_verified_repository(repo):
    integrity.sign_repository(repo)
    with running_server(repo, model_control_mode="explicit", load_models=("add_sub_py",)) as s:
        client = httpclient.InferenceServerClient(s.http_url)
        try:
            config = json.dumps({"backend": "python", "max_batch_size": 0,
                                 "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
                                 "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}]})
            with pytest.raises(InferenceServerException, match="file:"):
                client.load_model("injected", config=config,
                                  files={"file:1/model.py": b"import os  # the client's code"})
            client.load_model("string_py")  # a listed, untouched model still loads on request
            assert client.is_model_ready("string_py")
        finally:
            client.close()
