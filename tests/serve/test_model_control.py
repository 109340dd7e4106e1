"""The model control API's input (serve/model_control.py, the HTTP and gRPC repository routes): a model
name is one folder of the repository, never a path out of it; load and unload parameters are the ones
Triton knows, of the types it documents; each mistake is the client's 400 / INVALID_ARGUMENT naming
what is wrong, and nothing outside the repository is read, run or written."""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2 as spb
from tritonclient.grpc import service_pb2_grpc as sgrpc

from azulite.errors import InvalidArgument
from azulite.serve.dataplane import DataPlaneSettings, TritonDataPlane

from .conftest import MODELS_DIR, build_model_repository
from .frontends import running_server

BAD_NAMES = ("../outside", "..", ".", "", "a/b", "/abs", "sub\\x", "nul\x00")


@pytest.fixture()
def repo(tmp_path) -> Path:
    """add_sub_py in the repository and, beside the repository, a model whose code leaves a mark when it runs."""
    root = build_model_repository(tmp_path / "repo", ("add_sub_py", "string_py"))
    outside = tmp_path / "outside"
    (outside / "1").mkdir(parents=True)
    (outside / "config.pbtxt").write_text((MODELS_DIR / "add_sub_py" / "config.pbtxt").read_text()
                                          .replace('name: "add_sub_py"\n', ""))
    (outside / "1" / "model.py").write_text(f"open({str(tmp_path / 'RAN')!r}, 'w').close()\n"
                                            + (MODELS_DIR / "add_sub_py" / "model.py").read_text())
    return root


def test_a_model_name_is_a_folder_of_the_repository(repo):
    dp = TritonDataPlane(DataPlaneSettings(repository=repo, control_mode="explicit", load_models=("../outside",)))
    assert not dp.ready()  # a --load-model that is not a model name fails startup's readiness, naming it
    reason = {m.name: m.reason for m in dp.repository_index().models}["../outside"]
    assert "'../outside' is not a model name" in reason
    config = json.dumps({"backend": "python", "max_batch_size": 0,
                         "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [1]}],
                         "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [1]}]})

    async def main():
        for name in BAD_NAMES:
            for params in (None, {"config": config}, {"config": config, "file:1/model.py": b"pass\n"}):
                with pytest.raises(InvalidArgument, match="is not a model name") as info:
                    await dp.load_model(name, params)
                assert repr(name) in str(info.value) or f"'{name}'" in str(info.value)
            with pytest.raises(InvalidArgument, match="is not a model name"):
                await dp.unload_model(name)
        await dp.load_model("add_sub_py")  # a real name still loads
        assert dp.model_ready("add_sub_py")
        await dp.shutdown()

    asyncio.run(main())
    assert not (repo.parent / "RAN").exists()  # the outside model's code never ran
    assert {m.name for m in dp.repository_index().models} == {"add_sub_py", "string_py", "../outside"}
    assert not list(repo.parent.glob("**/written*"))


def _post(url: str, path: str, body: bytes) -> tuple[int, str]:
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    answer = json.loads(text) if text else {}
    return response.status, (answer.get("error", "") if isinstance(answer, dict) else "")


def test_load_and_unload_parameters_over_http_and_grpc(repo):
    P = spb.ModelRepositoryParameter
    good_config = '{"max_batch_size": 2}'
    with running_server(repo, model_control_mode="explicit") as server:
        http_cases = [  # (path, body, status, words in the error)
            ("/v2/repository/models/string_py/load", {"parameters": {"foo": "bar"}}, 400, "unrecognized load parameter 'foo'"),
            ("/v2/repository/models/string_py/load", {"parameters": {"config": 5}}, 400, "'config'"),
            ("/v2/repository/models/string_py/load", {"parameters": {"config": None}}, 400, "'config'"),
            ("/v2/repository/models/string_py/load", {"parameters": {"file:1/model.py": 5}}, 400, "'file:1/model.py'"),
            ("/v2/repository/models/string_py/unload", {"parameters": {"unload_dependents": "false"}}, 400,
             "'unload_dependents' must be a JSON boolean"),
            ("/v2/repository/index", {"ready": "yes"}, 400, "'ready' must be a JSON boolean"),
            ("/v2/repository/models/..%2Foutside/load", {}, 400, "'../outside' is not a model name"),
            ("/v2/repository/models/string_py/load", {"parameters": {"config": good_config}}, 200, ""),
            ("/v2/repository/models/string_py/load", {"parameters": {"config": {"max_batch_size": 4}}}, 200, ""),
            ("/v2/repository/models/string_py/unload", {"parameters": {"unload_dependents": False}}, 200, ""),
            ("/v2/repository/index", {"ready": True}, 200, ""),
        ]
        for path, body, status, words in http_cases:
            got = _post(server.http_url, path, json.dumps(body).encode())
            assert got[0] == status and words in got[1], (path, body, got)
        stub = sgrpc.GRPCInferenceServiceStub(channel := grpc.insecure_channel(server.grpc_url))
        grpc_cases = [  # (call, request, words); each is INVALID_ARGUMENT
            (stub.RepositoryModelLoad, spb.RepositoryModelLoadRequest(
                model_name="string_py", parameters={"foo": P(string_param="bar")}), "unrecognized load parameter 'foo'"),
            (stub.RepositoryModelLoad, spb.RepositoryModelLoadRequest(
                model_name="string_py", parameters={"config": P(int64_param=5)}),
             "invalid value type for load parameter 'config', expected string_param"),
            (stub.RepositoryModelLoad, spb.RepositoryModelLoadRequest(
                model_name="string_py", parameters={"config": P(string_param=good_config),
                                                    "file:1/model.py": P(string_param="x")}),
             "invalid value type for load parameter 'file:1/model.py', expected bytes_param"),
            (stub.RepositoryModelUnload, spb.RepositoryModelUnloadRequest(
                model_name="string_py", parameters={"unload_dependents": P(string_param="yes")}),
             "invalid value type for 'unload_dependents' parameter, expected bool_param"),
            (stub.RepositoryModelLoad, spb.RepositoryModelLoadRequest(model_name="../outside"),
             "'../outside' is not a model name"),
            (stub.RepositoryModelLoad, spb.RepositoryModelLoadRequest(model_name=""), "'' is not a model name"),
        ]
        for call, request, words in grpc_cases:
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details(), \
                (request, info.value.details())
        stub.RepositoryModelLoad(spb.RepositoryModelLoadRequest(
            model_name="string_py", parameters={"config": P(string_param=good_config)}), timeout=60)
        model_py = (MODELS_DIR / "string_py" / "model.py").read_bytes()
        stub.RepositoryModelLoad(spb.RepositoryModelLoadRequest(model_name="string_py", parameters={
            "config": P(string_param=good_config), "file:1/model.py": P(bytes_param=model_py)}), timeout=60)
        stub.RepositoryModelUnload(spb.RepositoryModelUnloadRequest(
            model_name="string_py", parameters={"unload_dependents": P(bool_param=True)}), timeout=60)
        channel.close()
        status, _ = _post(server.http_url, "/v2/repository/models/string_py/load", json.dumps({"parameters": {
            "config": good_config, "file:1/model.py": base64.b64encode(model_py).decode()}}).encode())
        assert status == 200
    assert not (repo.parent / "RAN").exists()
