"""Corners of the protocol where azulite answered otherwise than Triton, each asked of real Triton 2.51 (the
anchors installer's, Python backend) and of azulite serve, the answers compared: what a model sees of the
request's parameters, a request with no inputs to a model whose inputs are all optional, an output the
model left out or one requested twice, a model that was unloaded, an output placed in a region and asked
as binary data too, a CUDA region asked for by name, a version that is not a number, a model that is not
ready, a streamed response's final flag, an answer asked compressed, and the request id errors name. Each exchange returns what a client sees (status codes,
bodies, output names and values) so one comparison covers it.

Known and kept (azulite answers differently on purpose, README "Serving"): a client's malformed request is a
400 / INVALID_ARGUMENT where Triton answers 500 / INTERNAL; unloading a model the repository lacks is a 404;
integers out of their datatype's range are refused, not wrapped."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from .conftest import build_model_repository
from .frontends import running_server

MODELS = ("params_py", "optional_py", "string_py")


def _http(url: str, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
    req = urllib.request.Request(f"http://{url}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def _outputs(doc) -> list:
    """(name, data) of each output of a JSON infer response, in its order."""
    return [(o["name"], o.get("data")) for o in doc.get("outputs", [])] if isinstance(doc, dict) else doc


def _answer(call):
    """The call's value, or its error's status: a refusal is an answer to compare like any other."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - the status is the answer
        return str(e.status()) if hasattr(e, "status") else type(e).__name__


def _code(call) -> str:
    answer = _answer(call)
    return answer if isinstance(answer, str) else "OK"


def _rpc_code(call) -> str:
    """A raw stub call's status code's name ("OK" when it answered)."""
    import grpc

    try:
        call()
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


X = {"name": "X", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}


def exchanges(http: str, grpc_url: str) -> dict:
    out: dict = {}
    # what the model sees of the request's parameters: the protocol's own are not passed on, compact JSON
    status, doc = _http(http, "POST", "/v2/models/params_py/infer",
                        {"inputs": [X], "parameters": {"p": "v", "sequence_id": 0, "priority": 0, "timeout": 0,
                                                       "binary_data_output": False}})
    out["params over HTTP"] = status, _outputs(doc)[:1]
    g = tg.InferenceServerClient(grpc_url)
    x = tg.InferInput("X", [2], "FP32")
    x.set_data_from_numpy(np.array([1, 2], np.float32))
    out["params over gRPC"] = _answer(lambda: json.loads(g.infer(  # a map's order is the server's own
        "params_py", [x], parameters={"p": "v", "n": 3}, priority=0, timeout=0).as_numpy("PARAMS")[0]))
    # no inputs at all, to a model whose inputs are all optional
    status, doc = _http(http, "POST", "/v2/models/optional_py/infer", {"inputs": []})
    out["no inputs over HTTP"] = status, _outputs(doc)
    out["no inputs over gRPC"] = _answer(lambda: g.infer("optional_py", []).as_numpy("COUNT").tolist())
    # an output the model left out, requested; an output requested twice
    status, doc = _http(http, "POST", "/v2/models/params_py/infer", {"inputs": [X], "outputs": [{"name": "NEVER"}]})
    out["left-out output over HTTP"] = status, _outputs(doc)
    out["left-out output over gRPC"] = _answer(lambda: [o.name for o in g.infer(
        "params_py", [x], outputs=[tg.InferRequestedOutput("NEVER")]).get_response().outputs])
    status, doc = _http(http, "POST", "/v2/models/params_py/infer",
                        {"inputs": [X], "outputs": [{"name": "Y"}, {"name": "Y"}]})
    out["output named twice over HTTP"] = status, _outputs(doc)
    out["output named twice over gRPC"] = _answer(lambda: [o.name for o in g.infer(
        "params_py", [x], outputs=[tg.InferRequestedOutput("Y"), tg.InferRequestedOutput("Y")]).get_response().outputs])
    # an output placed in a region and asked as binary data: refused before the region is looked up
    status, doc = _http(http, "POST", "/v2/models/params_py/infer", {"inputs": [X], "outputs": [{
        "name": "Y", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8, "binary_data": True}}]})
    out["region and binary_data"] = status, "can't set both" in str(doc)
    # a CUDA region asked for by name (none is registered)
    out["CUDA region by name over HTTP"] = _http(http, "GET", "/v2/cudasharedmemory/region/c/status")[0]
    out["CUDA region by name over gRPC"] = _code(lambda: g.get_cuda_shared_memory_status("c"))
    # versions that are no number
    out["version abc over gRPC"] = (_code(lambda: g.is_model_ready("params_py", "abc")),
                                    _code(lambda: g.get_model_metadata("params_py", "abc")))
    out["version not digits over HTTP"] = [_http(http, "GET", f"/v2/models/params_py/versions/{v}/ready")[0]
                                           for v in ("abc", "-1", "+1")]
    # a model that is not ready says so in the body
    out["not ready"] = _http(http, "GET", "/v2/models/nope/ready")
    # the log file is never set over the network, whatever the value (the current one included)
    out["log_file"] = _http(http, "POST", "/v2/logging", {"log_file": ""})[0]
    # an unloaded model is not found (404 / NOT_FOUND, not a 503 to retry)
    g.unload_model("string_py")
    out["unloaded over HTTP"] = [_http(http, m, f"/v2/models/string_py{p}", b)[0] for m, p, b in (
        ("GET", "", None), ("GET", "/config", None),
        ("POST", "/infer", {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": ["a"]}]}))]
    out["unloaded over gRPC"] = (_code(lambda: g.get_model_metadata("string_py")),
                                 _code(lambda: g.get_model_config("string_py")))
    g.load_model("string_py")
    # a repository named: Triton ignores the name for an HTTP index, refuses it for a load or unload (501),
    # and refuses it for all three over gRPC (UNIMPLEMENTED)
    out["repository_name over HTTP"] = [_http(http, "POST", f"/v2/repository/other{p}", {})[0] for p in (
        "/index", "/models/params_py/load", "/models/params_py/unload")]
    stub = g._client_stub
    out["repository_name over gRPC"] = [_rpc_code(lambda: call(request(repository_name="other", **kw))) for call, request, kw in (
        (stub.RepositoryIndex, pb.RepositoryIndexRequest, {}),
        (stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest, {"model_name": "params_py"}),
        (stub.RepositoryModelUnload, pb.RepositoryModelUnloadRequest, {"model_name": "params_py"}))]
    out["stream"] = _stream(grpc_url)
    out["request id in errors"] = _request_id_errors(http, g._client_stub)
    g.close()
    out["compressed answers"] = _compressed(http)
    out["config override on reload"] = _override_kept(http)
    return out


def _request_id_errors(http: str, stub) -> list:
    """The first line of each error, over HTTP and gRPC: Triton prefixes those it finds holding a request
    against its model with ``[request id: ID]`` (``<id_unknown>`` without one), not an unknown input's."""
    import grpc

    cases = (("rid-7", "INT32", "X"), ("", "INT32", "X"), ("rid-7", "FP32", "NOPE"))
    seen = []
    for rid, datatype, name in cases:
        tensor = {"name": name, "datatype": datatype, "shape": [2], "data": [1, 2]}
        status, doc = _http(http, "POST", "/v2/models/params_py/infer",
                            {**({"id": rid} if rid else {}), "inputs": [tensor]})
        seen.append((status, str(doc.get("error") if isinstance(doc, dict) else doc).split("\n")[0]))
        request = pb.ModelInferRequest(model_name="params_py", id=rid)
        t = request.inputs.add(name=name, datatype=datatype, shape=[2])
        (t.contents.int_contents if datatype == "INT32" else t.contents.fp32_contents).extend([1, 2])
        try:
            stub.ModelInfer(request)
            seen.append("OK")
        except grpc.RpcError as e:
            seen.append((e.code().name, e.details().split("\n")[0]))
    status, doc = _http(http, "POST", "/v2/models/params_py/infer", {"id": "rid-8", "inputs": []})
    seen.append((status, str(doc.get("error") if isinstance(doc, dict) else doc).split("\n")[0]))
    return seen


def _override_kept(http: str) -> list:
    """max_batch_size after a load with a config override, after a load without one (Triton keeps the
    override), and after an unload and a load (config.pbtxt's again)."""
    def batch() -> int:
        return _http(http, "GET", "/v2/models/params_py/config")[1].get("max_batch_size", 0)

    config = _http(http, "GET", "/v2/models/params_py/config")[1]
    seen = [batch()]
    _http(http, "POST", "/v2/repository/models/params_py/load",
          {"parameters": {"config": json.dumps({**config, "max_batch_size": 3})}})
    seen.append(batch())
    _http(http, "POST", "/v2/repository/models/params_py/load", {})
    seen.append(batch())
    _http(http, "POST", "/v2/repository/models/params_py/unload", {})
    _http(http, "POST", "/v2/repository/models/params_py/load", {})
    seen.append(batch())
    return seen


def _compressed(http: str) -> list:
    """An infer answer asked compressed (tritonclient's response_compression_algorithm; Accept-Encoding):
    the encoding the server answered with, and the answer as tritonclient reads it."""
    import tritonclient.http as th

    client = th.InferenceServerClient(http)
    x = th.InferInput("X", [2], "FP32")
    x.set_data_from_numpy(np.array([1, 2], np.float32))
    seen = [client.infer("params_py", [x], response_compression_algorithm=algorithm).as_numpy("Y").tolist()
            for algorithm in ("gzip", "deflate")]
    client.close()
    for accept in ("gzip", "deflate", "br, deflate", "gzip;q=0, deflate", "br"):
        req = urllib.request.Request(f"http://{http}/v2/models/params_py/infer", method="POST",
                                     data=json.dumps({"inputs": [X]}).encode(), headers={"Accept-Encoding": accept})
        with urllib.request.urlopen(req, timeout=60) as r:
            seen.append((accept, r.headers.get("Content-Encoding")))
    return seen


def _stream(grpc_url: str) -> list:
    """A stream's responses, raw: a model that answers once and one that answers with an error; each
    response's final flag, model name and error."""
    import grpc

    with grpc.insecure_channel(grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        def request(rid: str, value: float) -> pb.ModelInferRequest:
            r = pb.ModelInferRequest(model_name="params_py", id=rid)
            t = r.inputs.add(name="X", datatype="FP32", shape=[1])
            t.contents.fp32_contents.append(value)
            return r

        seen = []
        for answer in stub.ModelStreamInfer(iter([request("ok", 1.0), request("bad", -1.0)])):
            r = answer.infer_response
            final = r.parameters["triton_final_response"].bool_param if "triton_final_response" in r.parameters else None
            seen.append((r.id, final, r.model_name, bool(answer.error_message)))
    return sorted(seen)


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    from .anchor import running_triton

    root = tmp_path_factory.mktemp("protocol")
    repo = build_model_repository(root / "repo", MODELS)
    with running_triton(repo, root / "triton.log",
                        args=("--model-control-mode=explicit", *(f"--load-model={m}" for m in MODELS))) as triton:
        theirs = exchanges(triton.http_url, triton.grpc_url)
    with running_server(repo, model_control_mode="explicit", load_models=MODELS) as s:
        ours = exchanges(s.http_url, s.grpc_url)
    return theirs, ours


@pytest.mark.parametrize("case", [
    "params over HTTP", "params over gRPC", "no inputs over HTTP", "no inputs over gRPC",
    "left-out output over HTTP", "left-out output over gRPC", "output named twice over HTTP",
    "output named twice over gRPC", "region and binary_data", "CUDA region by name over HTTP",
    "CUDA region by name over gRPC", "version abc over gRPC", "version not digits over HTTP", "not ready",
    "unloaded over HTTP", "unloaded over gRPC", "stream", "compressed answers", "log_file",
    "repository_name over HTTP", "repository_name over gRPC", "config override on reload", "request id in errors",
])
def test_answers_as_triton(answers, case):
    theirs, ours = answers
    assert ours[case] == theirs[case]


def test_the_answers_compared_are_the_ones_expected(answers):
    """What Triton answered, pinned: a Triton whose answers changed would pass the comparison silently."""
    theirs, _ = answers
    assert theirs["params over HTTP"] == (200, [("PARAMS", ['{"p":"v"}'])])
    assert theirs["params over gRPC"] == {"p": "v", "n": 3}
    assert theirs["no inputs over HTTP"] == (200, [("COUNT", [0])])
    assert theirs["output named twice over gRPC"] == ["Y"]
    assert theirs["unloaded over HTTP"] == [404, 404, 404]
    assert theirs["stream"] == [("bad", True, "params_py", True), ("ok", True, "params_py", False)]
    assert theirs["repository_name over HTTP"] == [200, 501, 501]
    assert theirs["config override on reload"] == [0, 3, 3, 0]
    assert theirs["repository_name over gRPC"] == ["UNIMPLEMENTED"] * 3
    assert theirs["request id in errors"][:2] == [
        (400, "[request id: rid-7] inference input 'X' data-type is 'INT32', but model 'params_py' expects 'FP32'"),
        ("INVALID_ARGUMENT",
         "[request id: rid-7] inference input 'X' data-type is 'INT32', but model 'params_py' expects 'FP32'")]
    assert theirs["request id in errors"][2][1].startswith("[request id: <id_unknown>] inference input 'X'")
    assert theirs["request id in errors"][4][1] == "unexpected inference input 'NOPE' for model 'params_py'"
    assert theirs["compressed answers"][:4] == [[2.0, 4.0], [2.0, 4.0], ("gzip", "gzip"), ("deflate", "deflate")]
