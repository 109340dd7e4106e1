"""The HTTP front-end, driven by Triton's own clients (tritonclient.http, sync and asyncio) and by raw
HTTP for what a client library would never send, against the shared test repository on a real server."""

from __future__ import annotations

import asyncio
import http.client
import json

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from .conftest import bench_weights, tasks_created
from .frontends import running_server


@pytest.fixture(scope="module")
def server(model_repository):
    with running_server(model_repository) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    yield c
    c.close()


def raw(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    host, port = server.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def add_sub_inputs(x, y, names=("INPUT0", "INPUT1"), binary=True):
    inputs = []
    for name, value in zip(names, (x, y)):
        i = httpclient.InferInput(name, list(value.shape), "FP32")
        i.set_data_from_numpy(value, binary_data=binary)
        inputs.append(i)
    return inputs


def error_of(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


# --- health, metadata, config, statistics ------------------------------------------------------------


def test_health_and_server_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "azulite"
    assert "binary_tensor_data" in meta["extensions"]
    assert "classification" in meta["extensions"]


def test_model_metadata_and_ready(client):
    assert client.is_model_ready("add_sub_onnx")
    assert client.is_model_ready("versioned_py", "2")
    assert not client.is_model_ready("no_such_model")
    meta = client.get_model_metadata("add_sub_onnx")
    assert meta["name"] == "add_sub_onnx"
    assert meta["platform"] == "onnxruntime_onnx"
    assert [i["name"] for i in meta["inputs"]] == ["INPUT0", "INPUT1"]
    assert meta["inputs"][0]["shape"] == [-1, 16] and meta["inputs"][0]["datatype"] == "FP32"
    assert sorted(client.get_model_metadata("versioned_py")["versions"]) == ["1", "2"]


def test_model_config_numbers_not_strings(client):
    config = client.get_model_config("add_sub_onnx")
    assert config["max_batch_size"] == 8
    assert config["input"][0]["dims"] == [16]  # json_format would give ["16"]
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 500
    bench = client.get_model_config("bench_matmul")
    assert bench["max_batch_size"] == 64 and bench["instance_group"][0]["count"] == 1


def test_statistics_count_inferences(client):
    x = np.ones((1, 16), np.float32)
    before = client.get_inference_statistics("add_sub_py")["model_stats"][0]
    client.infer("add_sub_py", add_sub_inputs(x, x))
    stats = client.get_inference_statistics("add_sub_py")["model_stats"][0]
    assert stats["name"] == "add_sub_py" and stats["version"] == "1"
    success = stats["inference_stats"]["success"]
    assert isinstance(success["count"], int)
    assert success["count"] == before["inference_stats"]["success"]["count"] + 1
    everything = client.get_inference_statistics()["model_stats"]
    assert {"add_sub_onnx", "add_sub_py", "string_py"} <= {m["name"] for m in everything}
    with pytest.raises(InferenceServerException) as err:  # Triton answers 400 for a model it does not know
        client.get_inference_statistics("no_such_model")
    assert err.value.status() == "400" and "no_such_model" in err.value.message()


def test_repository_index(client):
    index = {(m["name"], m.get("version")): m for m in client.get_model_repository_index()}
    assert index[("add_sub_onnx", "1")]["state"] == "READY"
    assert index[("versioned_py", "2")]["state"] == "READY"


# --- infer -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize(("model", "ins", "outs"), [
    ("add_sub_onnx", ("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1")),
    ("add_sub_pt", ("INPUT__0", "INPUT__1"), ("OUTPUT__0", "OUTPUT__1")),
    ("add_sub_py", ("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1")),
])
def test_infer_add_sub(client, model, ins, outs, binary):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    y = rng.standard_normal((3, 16)).astype(np.float32)
    requested = [httpclient.InferRequestedOutput(o, binary_data=binary) for o in outs]
    result = client.infer(model, add_sub_inputs(x, y, ins, binary), outputs=requested, request_id="r-7")
    np.testing.assert_allclose(result.as_numpy(outs[0]), x + y, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy(outs[1]), x - y, rtol=1e-6)
    response = result.get_response()
    assert response["model_name"] == model and response["id"] == "r-7"


def test_infer_all_outputs_by_default(client):
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    result = client.infer("add_sub_onnx", add_sub_inputs(x, x))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * x)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), 0 * x)


@pytest.mark.parametrize("binary", [True, False])
def test_infer_bytes_tensors(client, binary):
    text = np.array([[b"hello", b"Triton", "\u00e9t\u00e9".encode()]], dtype=np.object_)
    i = httpclient.InferInput("TEXT", [1, 3], "BYTES")
    i.set_data_from_numpy(text, binary_data=binary)
    outs = [httpclient.InferRequestedOutput("UPPER", binary_data=binary),
            httpclient.InferRequestedOutput("LENGTH", binary_data=binary)]
    result = client.infer("string_py", [i], outputs=outs)
    upper = result.as_numpy("UPPER")
    assert upper.shape == (1, 3)
    assert [v if isinstance(v, bytes) else v.encode() for v in upper.reshape(-1)] == \
        [t.upper() for t in text.reshape(-1)]  # the model upper-cases bytes (ASCII letters)
    assert result.as_numpy("LENGTH").tolist() == [[len(t) for t in text.reshape(-1)]]


def test_infer_versions(client):
    x = np.zeros(4, np.float32)
    for version, expected in (("1", 1.0), ("2", 2.0)):
        i = httpclient.InferInput("INPUT0", [4], "FP32")
        i.set_data_from_numpy(x)
        result = client.infer("versioned_py", [i], model_version=version)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + expected)
        assert result.get_response()["model_version"] == version


def test_classification_extension(client):
    x = np.array([[0, 5, 1, 9, 3, 2, 7, 4, 8, 6, 0, 0, 0, 0, 0, 0]], np.float32)
    zeros = np.zeros_like(x)
    result = client.infer("add_sub_onnx", add_sub_inputs(x, zeros),
                          outputs=[httpclient.InferRequestedOutput("OUTPUT0", class_count=3)])
    top = [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("OUTPUT0").reshape(-1)]
    assert [t.split(":")[1] for t in top] == ["3", "8", "6"]
    assert float(top[0].split(":")[0]) == 9.0


@pytest.mark.parametrize("k", ['"three"', '"2"', "-1", "2.5", "true"])  # "2": a string, as Triton refuses it
def test_a_bad_classification_count_is_a_400_naming_it(server, k):
    doc = ('{"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": %s},'
           ' {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "data": %s}],'
           ' "outputs": [{"name": "OUTPUT0", "parameters": {"classification": %s}}]}') % ([1.0] * 16, [1.0] * 16, k)
    status, _, body = raw(server, "POST", "/v2/models/add_sub_onnx/infer", doc.encode())
    assert status == 400, body
    assert "parameter 'classification' must be a positive integer" in json.loads(body)["error"]


def test_bench_model_matches_numpy(client):
    x = np.linspace(-1, 1, 2 * 256, dtype=np.float32).reshape(2, 256)
    i = httpclient.InferInput("x", [2, 256], "FP32")
    i.set_data_from_numpy(x)
    result = client.infer("bench_matmul", [i])
    np.testing.assert_allclose(result.as_numpy("y"), x @ bench_weights(), rtol=1e-5, atol=1e-5)


def test_asyncio_client_concurrent(server):
    async def main():
        client = aiohttpclient.InferenceServerClient(server.http_url)
        try:
            assert await client.is_server_ready()
            assert (await client.get_model_metadata("add_sub_py"))["name"] == "add_sub_py"
            config = await client.get_model_config("add_sub_py")
            assert config["instance_group"][0]["count"] == 2

            async def one(k):
                x = np.full((1, 16), k, np.float32)
                result = await client.infer("add_sub_py", add_sub_inputs(x, x))
                return result.as_numpy("OUTPUT0")

            results = await asyncio.gather(*(one(k) for k in range(24)))
            for k, out in enumerate(results):
                np.testing.assert_array_equal(out, np.full((1, 16), 2 * k, np.float32))
        finally:
            await client.close()

    asyncio.run(main())


def test_gzip_request_body(client):
    x = np.ones((1, 16), np.float32)
    result = client.infer("add_sub_onnx", add_sub_inputs(x, x), request_compression_algorithm="gzip")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * x)


# --- bad input -----------------------------------------------------------------------------------------


def test_infer_requests_on_a_known_path_take_no_task_each(server, client):
    """After the first request of an infer path, its requests are answered by callback (HttpApp._infer_now,
    TritonDataPlane.infer_then): no Task per request on the server's loop, and the answers, the errors
    and the statistics are the coroutine path's."""
    x = np.ones((2, 16), np.float32)
    client.infer("add_sub_py", add_sub_inputs(x, x))  # the path is routed (and cached)
    before = client.get_inference_statistics("add_sub_py")["model_stats"][0]["inference_stats"]
    with tasks_created(server.call) as created:
        for i in range(8):
            result = client.infer("add_sub_py", add_sub_inputs(x * i, x))
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * i + x)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), x * i - x)
        # a bad request on the same path: still a 400 naming what is wrong
        err = error_of(lambda: client.infer("add_sub_py", add_sub_inputs(np.ones((2, 15), np.float32), x)))
        assert err.status() == "400" and "INPUT0" in err.message()
        infer_tasks = [name for name in created if "infer" in name.lower()]
    assert infer_tasks == []
    after = client.get_inference_statistics("add_sub_py")["model_stats"][0]["inference_stats"]
    assert after["success"]["count"] == before["success"]["count"] + 8
    assert after["fail"]["count"] == before["fail"]["count"] + 1


def test_wrong_input_name_is_400(client):
    x = np.ones((1, 16), np.float32)
    err = error_of(lambda: client.infer("add_sub_onnx", add_sub_inputs(x, x, ("INPUT0", "NOPE"))))
    assert err.status() == "400"
    assert "NOPE" in err.message()


def test_wrong_dtype_is_400(client):
    x = np.ones((1, 16), np.int32)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        i = httpclient.InferInput(name, [1, 16], "INT32")
        i.set_data_from_numpy(x)
        inputs.append(i)
    err = error_of(lambda: client.infer("add_sub_onnx", inputs))
    assert err.status() == "400"
    assert "INT32" in err.message() and "FP32" in err.message()


def test_wrong_shape_is_400(client):
    x = np.ones((1, 15), np.float32)
    err = error_of(lambda: client.infer("add_sub_onnx", add_sub_inputs(x, x)))
    assert err.status() == "400"
    assert "INPUT0" in err.message() and "15" in err.message()


def test_unknown_model_and_version_are_404(client):
    x = np.ones((1, 16), np.float32)
    err = error_of(lambda: client.infer("no_such_model", add_sub_inputs(x, x)))
    assert err.status() == "404" and "no_such_model" in err.message()
    err = error_of(lambda: client.infer("add_sub_onnx", add_sub_inputs(x, x), model_version="7"))
    assert err.status() == "404" and "7" in err.message()
    err = error_of(lambda: client.get_model_metadata("no_such_model"))
    assert err.status() == "404"
    err = error_of(lambda: client.get_model_config("no_such_model"))
    assert err.status() == "404"


def test_malformed_json_is_400(server):
    status, headers, body = raw(server, "POST", "/v2/models/add_sub_onnx/infer", b'{"inputs": [',
                                {"Content-Type": "application/json"})
    assert status == 400
    assert "malformed JSON" in json.loads(body)["error"]


def test_json_element_count_mismatch_is_400(server):
    doc = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 3},
                      {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]}
    status, _, body = raw(server, "POST", "/v2/models/add_sub_onnx/infer", json.dumps(doc).encode())
    assert status == 400
    assert "INPUT0" in json.loads(body)["error"] and "16" in json.loads(body)["error"]


def test_binary_size_mismatch_is_400(server):
    header = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 60}},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 60}},
    ]}).encode()
    body = header + b"\0" * 120
    status, _, answer = raw(server, "POST", "/v2/models/add_sub_onnx/infer", body,
                            {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400
    message = json.loads(answer)["error"]
    assert "INPUT0" in message and "60" in message and "64" in message
    # and a size that runs past the end of the body
    status, _, answer = raw(server, "POST", "/v2/models/add_sub_onnx/infer", header + b"\0" * 10,
                            {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and "past the end" in json.loads(answer)["error"]


def test_json_infer_response_without_binary(server):
    doc = {"id": "j1", "inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [[float(i) for i in range(16)]]},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]}
    status, headers, body = raw(server, "POST", "/v2/models/add_sub_onnx/infer", json.dumps(doc).encode())
    assert status == 200
    answer = json.loads(body)
    assert answer["id"] == "j1" and answer["model_name"] == "add_sub_onnx" and answer["model_version"] == "1"
    out = {o["name"]: o for o in answer["outputs"]}
    assert out["OUTPUT0"]["data"] == [float(i + 1) for i in range(16)]
    assert out["OUTPUT0"]["shape"] == [1, 16] and out["OUTPUT0"]["datatype"] == "FP32"


def test_oversized_body_is_413_and_server_keeps_serving(model_repository):
    with running_server(model_repository, http_max_input_size=4096) as s:
        status, _, body = raw(s, "POST", "/v2/models/add_sub_onnx/infer", b"{" + b" " * 10000 + b"}")
        assert status == 413
        assert "exceeds" in json.loads(body)["error"]
        c = httpclient.InferenceServerClient(s.http_url)
        try:
            x = np.ones((1, 16), np.float32)
            np.testing.assert_array_equal(c.infer("add_sub_onnx", add_sub_inputs(x, x)).as_numpy("OUTPUT0"), 2 * x)
        finally:
            c.close()


def test_unknown_endpoints_and_unsupported_extensions(server):
    assert raw(server, "GET", "/v3/nothing")[0] == 404
    assert raw(server, "PUT", "/v2/health/live")[0] == 405
    assert raw(server, "GET", "/v2/models/add_sub_onnx/infer")[0] == 405
    assert raw(server, "GET", "/v2/models/add_sub_onnx/nothing")[0] == 404
    status, _, body = raw(server, "GET", "/v2/logging")  # the logging extension (tests/serve/test_log_settings.py)
    assert status == 200 and set(json.loads(body)) == {"log_file", "log_info", "log_warning", "log_error",
                                                        "log_verbose_level", "log_format"}
    assert raw(server, "PUT", "/v2/logging")[0] == 405 and raw(server, "GET", "/v2/logging/more")[0] == 404
    status, _, body = raw(server, "GET", "/v2/trace/setting")  # the trace extension (tests/serve/test_trace.py)
    assert status == 200 and json.loads(body)["trace_level"] == ["OFF"]
    assert raw(server, "GET", "/v2/trace")[0] == 404 and raw(server, "PUT", "/v2/trace/setting")[0] == 405
    status, _, body = raw(server, "GET", "/v2/systemsharedmemory/status")
    assert status == 200 and json.loads(body) == []
    status, _, body = raw(server, "POST", "/v2/cudasharedmemory/region/r0/register",
                          json.dumps({"raw_handle": {"b64": "aGFuZGxl"}, "device_id": 0, "byte_size": 64}).encode())
    assert status == 501 and "shared memory" in json.loads(body)["error"]
    # the generate extension (serve/generate.py; tests/serve/test_generate.py): a request with no inputs is the
    # client's mistake, named
    status, _, body = raw(server, "POST", "/v2/models/add_sub_onnx/generate", b"{}")
    assert status == 400 and "missing required input" in json.loads(body)["error"]


def test_shared_memory_via_client(client):
    assert client.get_cuda_shared_memory_status() == []
    err = error_of(lambda: client.register_cuda_shared_memory("r0", b"aGFuZGxl", 0, 64))
    assert err.status() == "501"


def test_metrics_scraped_with_triton_names(server, client):
    x = np.ones((1, 16), np.float32)
    client.infer("add_sub_onnx", add_sub_inputs(x, x))
    host, port = server.metrics_url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    assert resp.status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
                 "nv_inference_exec_count", "nv_inference_pending_request_count",
                 "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                 "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
                 "nv_inference_compute_output_duration_us", "nv_cpu_utilization"):
        assert name in families, name
    success = {s.labels["model"]: s.value for s in families["nv_inference_request_success"].samples
               if s.labels.get("version") == "1"}
    assert success["add_sub_onnx"] >= 1


def test_expect_100_continue_and_pipelining(server):
    """curl sends large bodies only after '100 Continue'; two pipelined requests are answered in order."""
    import socket

    host, port = server.http_url.split(":")
    doc = json.dumps({"inputs": [
        {"name": n, "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16} for n in ("INPUT0", "INPUT1")]}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v2/models/add_sub_onnx/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(doc))
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(doc)
        sock.sendall(b"GET /v2/models/add_sub_onnx/ready HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK") == 3
    assert data.index(b'"OUTPUT0"') < data.index(b"HTTP/1.1 200 OK", data.index(b'"OUTPUT0"'))


def test_large_bytes_tensor(client):
    big = np.array([[b"abc" * 1_000_000]], dtype=np.object_)  # 3 MB each way
    i = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    i.set_data_from_numpy(big)
    result = client.infer("string_py", [i])
    assert result.as_numpy("UPPER")[0, 0] == b"ABC" * 1_000_000


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compressed_body_is_held_to_the_limit_once_inflated(server, client, encoding):
    """200 MiB of spaces compress to ~200 KiB: the body was inflated whole (gzip.decompress has no limit),
    taking the server's memory; now inflating stops past --http-max-input-size (64 MiB) with a 413."""
    import gzip
    import zlib

    bomb = (gzip.compress if encoding == "gzip" else zlib.compress)(b" " * (200 << 20))
    status, _, body = raw(server, "POST", "/v2/models/add_sub_onnx/infer", bomb, {"Content-Encoding": encoding})
    assert status == 413 and "inflates past the server's limit of 67108864 bytes" in json.loads(body)["error"]
    assert "--http-max-input-size" in json.loads(body)["error"]
    x = np.ones((1, 16), np.float32)
    np.testing.assert_array_equal(client.infer("add_sub_onnx", add_sub_inputs(x, x)).as_numpy("OUTPUT0"), 2 * x)


@pytest.mark.parametrize("path", ["/v2/models/add_sub_onnx/infer", "/v2/repository/index", "/v2/logging",
                                  "/v2/models/add_sub_onnx/generate"])
def test_json_nested_thousands_deep_is_a_400(server, path):
    # orjson refuses past 1024 levels and the standard library's parser recursed until RecursionError: a 500
    deep = b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,16],"data":' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"
    status, _, body = raw(server, "POST", path, deep)
    assert status == 400, body[:300]
    assert "nested" in json.loads(body)["error"]


def test_classification_of_a_bytes_output_is_a_400(client):
    text = httpclient.InferInput("TEXT", [1, 2], "BYTES")
    text.set_data_from_numpy(np.array([[b"a", b"b"]], dtype=np.object_))
    err = error_of(lambda: client.infer("string_py", [text], outputs=[httpclient.InferRequestedOutput("UPPER", class_count=1)]))
    assert err.status() == "400" and "output 'UPPER': classification needs a numeric output, and this one is BYTES" in err.message()


def test_a_region_named_by_a_number_is_a_400(server):
    # it was looked up as a region named '5' and answered 404
    region = {"shared_memory_region": 5, "shared_memory_byte_size": 64}
    body = json.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 16], "parameters": region}
                                  for n in ("INPUT0", "INPUT1")]}).encode()
    status, _, reply = raw(server, "POST", "/v2/models/add_sub_onnx/infer", body)
    assert status == 400 and "'shared_memory_region' must be a region's name (a string), got 5" in json.loads(reply)["error"]
