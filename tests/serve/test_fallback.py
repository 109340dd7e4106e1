"""Overload and degradation on a real server: a bounded queue answers 503 + Retry-After (HTTP) and
UNAVAILABLE (gRPC) instead of growing; a model's fallback answers when its queue is full, when it is
unloaded, and is marked in the response and counted in the metrics."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import shutil

import grpc
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from azulite.errors import ModelLoadError
from azulite.serve.fallback import FallbackPolicy, policy_of
from azulite.serve.proto import model_config_pb2 as mc

from .conftest import MODELS_DIR
from .frontends import running_server

# One instance that sleeps per batch of at most 1, a queue of at most 2: a burst of 12 must overflow it.
PRIMARY = """
name: "{name}"
backend: "python"
max_batch_size: 1
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
parameters {{ key: "delay_s" value: {{ string_value: "{delay}" }} }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{extra}
"""


BOUNDED = "dynamic_batching { default_queue_policy { max_queue_size: 2 } }\n"


def _model(root, name, delay, extra=""):
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(PRIMARY.format(name=name, delay=delay, extra=extra))
    shutil.copy(MODELS_DIR / "slow_py" / "model.py", root / name / "1" / "model.py")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("fallback_repo")
    _model(root, "bounded", 1.0, BOUNDED)
    _model(root, "guarded", 1.0, BOUNDED + 'parameters { key: "azulite_fallback_model" value: { string_value: "light" } }')
    _model(root, "light", 0.0, "dynamic_batching { }")  # unbounded queue
    return root


BODY = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [7.0]}]}).encode()


def _post(url, model):
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", body=BODY)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def _burst(url, model, n=12):
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: _post(url, model), range(n)))


@pytest.mark.parametrize("grpc_impl", ["h2", "grpcio"])
def test_bounded_queue_answers_503_with_retry_after(repo, grpc_impl):
    with running_server(repo, model_control_mode="explicit", load_models=("bounded",), grpc_impl=grpc_impl) as s:
        if grpc_impl == "h2":  # HTTP is the same server either way
            answers = _burst(s.http_url, "bounded")
            statuses = sorted(a[0] for a in answers)
            assert set(statuses) == {200, 503}, statuses  # at most 1 running + 2 queued can be accepted at once
            for status, headers, body in answers:
                if status == 503:
                    assert headers["Retry-After"] == "1" and b"Exceeds maximum queue size" in body
        channel = grpc.insecure_channel(s.grpc_url)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="bounded")
        t = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1])
        request.raw_input_contents.append(np.float32([7.0]).tobytes())
        assert t.name == "INPUT0"
        futures = [stub.ModelInfer.future(request, timeout=120) for _ in range(12)]
        codes = set()
        for f in futures:
            try:
                f.result()
                codes.add(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.add(exc.code())
                # as HTTP's Retry-After: the trailing metadata and the message say when to come back
                assert dict(exc.trailing_metadata())["retry-after"] == "1", exc.trailing_metadata()
                assert "Exceeds maximum queue size" in exc.details() and "retry after 1 s" in exc.details()
        assert codes == {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
        channel.close()


def test_fallback_answers_when_the_queue_is_full_or_the_model_unloaded(repo):
    with running_server(repo, model_control_mode="explicit", load_models=("guarded", "light")) as s:
        answers = _burst(s.http_url, "guarded")
        assert {a[0] for a in answers} == {200}  # nobody refused: the overflow went to the fallback
        docs = [json.loads(a[2]) for a in answers]
        fallen = [d for d in docs if d.get("parameters", {}).get("fallback_from") == "guarded"]
        assert fallen and all(d["model_name"] == "light" and d["parameters"]["fallback_reason"] == "queue_full"
                              for d in fallen)
        assert all(d["outputs"][0]["data"] == [7.0] for d in docs)
        client = httpclient.InferenceServerClient(s.http_url)
        client.unload_model("guarded")
        status, _, body = _post(s.http_url, "guarded")
        doc = json.loads(body)
        assert status == 200 and doc["parameters"] == {"fallback_from": "guarded", "fallback_reason": "unavailable"}
        client.close()
        host, port = s.metrics_url.split("//")[1].split("/")[0].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        assert 'azulite_fallback_total{model="guarded",fallback="light",reason="unavailable"} 1' in text
        assert f'azulite_fallback_total{{model="guarded",fallback="light",reason="queue_full"}} {len(fallen)}' in text


def test_with_its_fallback_unloaded_a_full_model_answers_its_own_503(repo):
    """The fallback unloaded too: a burst got 404 'unknown model: light' (the fallback's answer, naming a
    model the client never asked for); now the model's own 503 + Retry-After, and nothing counted."""
    with running_server(repo, model_control_mode="explicit", load_models=("guarded", "light")) as s:
        client = httpclient.InferenceServerClient(s.http_url)
        client.unload_model("light")
        answers = _burst(s.http_url, "guarded")
        refused = [a for a in answers if a[0] != 200]
        assert refused and {a[0] for a in refused} == {503}
        assert all("Retry-After" in a[1] and b"light" not in a[2] for a in refused)
        client.unload_model("guarded")  # both gone: the model's own 'not available'
        status, _, body = _post(s.http_url, "guarded")
        assert status in (404, 503) and b"'guarded'" in body and b"light" not in body
        client.close()
        host, port = s.metrics_url.split("//")[1].split("/")[0].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("GET", "/metrics")
        assert "azulite_fallback_total{" not in conn.getresponse().read().decode()


def test_fallback_parameters_are_validated():
    config = mc.ModelConfig(name="m")
    assert policy_of(config) is None
    config.parameters["azulite_fallback_model"].string_value = "light"
    config.parameters["azulite_fallback_queue_threshold"].string_value = "16"
    assert policy_of(config) == FallbackPolicy("light", 16)
    config.parameters["azulite_fallback_queue_threshold"].string_value = "many"
    with pytest.raises(ModelLoadError, match="azulite_fallback_queue_threshold"):
        policy_of(config)
    config.parameters["azulite_fallback_queue_threshold"].string_value = "1"
    config.parameters["azulite_fallback_model"].string_value = "m"
    with pytest.raises(ModelLoadError, match="must name another model"):
        policy_of(config)
