"""System shared memory (serve/shm.py) over HTTP and gRPC: tritonclient's own shared-memory utilities
(real /dev/shm objects made with shm_open) and its clients against a real azulite server, the bad inputs
the issue names, and perf_analyzer --shared-memory system."""

from __future__ import annotations

import base64
import http.client
import json
import subprocess
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from azulite.serve import cuda_shm

from .frontends import running_server
from .test_server import COUNT_WINDOWS, PERF_ANALYZER

PROTOCOLS = ("http", "grpc")


@pytest.fixture(scope="module")
def server(model_repository):
    with running_server(model_repository) as s:
        yield s


def make_client(server, protocol: str):
    if protocol == "http":
        return httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    return grpcclient.InferenceServerClient(server.grpc_url)


def lib(protocol: str):
    return httpclient if protocol == "http" else grpcclient


@pytest.fixture
def regions():
    """Creates shm regions with unique keys; destroys them all after the test."""
    made = []

    def create(size: int):
        key = f"/azulite-test-{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(key[1:], key, size)
        made.append(handle)
        return key, handle

    yield create
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def status_names(client, protocol: str) -> dict[str, tuple[str, int, int]]:
    if protocol == "http":
        return {r["name"]: (r["key"], int(r["offset"]), int(r["byte_size"]))
                for r in client.get_system_shared_memory_status()}
    return {n: (r.key, r.offset, r.byte_size) for n, r in client.get_system_shared_memory_status().regions.items()}


def error_of(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


def bad_arg(err: InferenceServerException, protocol: str) -> bool:
    return err.status() == ("400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT")


def not_found(err: InferenceServerException, protocol: str) -> bool:
    """Triton answers an unknown region NOT_FOUND (404), for status and infer alike."""
    return err.status() == ("404" if protocol == "http" else "StatusCode.NOT_FOUND")


def shm_add_sub(protocol, in_region, out_region, offsets=(0, 128), out_offsets=(0, 128), batch=2):
    m = lib(protocol)
    inputs = [m.InferInput(n, [batch, 16], "FP32") for n in ("INPUT0", "INPUT1")]
    for i, off in zip(inputs, offsets):
        i.set_shared_memory(in_region, batch * 64, offset=off)
    outputs = [m.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
    for o, off in zip(outputs, out_offsets):
        o.set_shared_memory(out_region, batch * 64, offset=off)
    return inputs, outputs


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_infer_with_inputs_and_outputs_in_shared_memory(server, regions, protocol):
    client = make_client(server, protocol)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    y = rng.standard_normal((2, 16)).astype(np.float32)
    in_key, in_handle = regions(256)
    out_key, out_handle = regions(256)
    shm.set_shared_memory_region(in_handle, [x, y])
    client.register_system_shared_memory(f"in-{protocol}", in_key, 256)
    client.register_system_shared_memory(f"out-{protocol}", out_key, 256)
    try:
        assert status_names(client, protocol) == {f"in-{protocol}": (in_key, 0, 256),
                                                  f"out-{protocol}": (out_key, 0, 256)}
        inputs, outputs = shm_add_sub(protocol, f"in-{protocol}", f"out-{protocol}")
        result = client.infer("add_sub_onnx", inputs, outputs=outputs)
        out0 = result.get_output("OUTPUT0")
        shape = out0["shape"] if protocol == "http" else list(out0.shape)
        assert shape == [2, 16]
        np.testing.assert_allclose(shm.get_contents_as_numpy(out_handle, np.float32, [2, 16]), x + y, rtol=1e-6)
        np.testing.assert_allclose(shm.get_contents_as_numpy(out_handle, np.float32, [2, 16], offset=128), x - y,
                                   rtol=1e-6)
        # the client rewrites its input region: the next answer follows
        shm.set_shared_memory_region(in_handle, [y, x])
        client.infer("add_sub_onnx", inputs, outputs=outputs)
        np.testing.assert_allclose(shm.get_contents_as_numpy(out_handle, np.float32, [2, 16], offset=128), y - x,
                                   rtol=1e-6)
        # mixed: one input in the body, one output in the body
        m = lib(protocol)
        body_in = m.InferInput("INPUT1", [2, 16], "FP32")
        body_in.set_data_from_numpy(x)
        body_out = m.InferRequestedOutput("OUTPUT1")
        result = client.infer("add_sub_onnx", [inputs[0], body_in], outputs=[outputs[0], body_out])
        np.testing.assert_allclose(shm.get_contents_as_numpy(out_handle, np.float32, [2, 16]), y + x, rtol=1e-6)
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), y - x, rtol=1e-6)
        if protocol == "grpc":  # as Triton: an empty raw entry for the output in a region
            assert list(result.get_response().raw_output_contents) == [b"", (y - x).tobytes()]
        else:  # as Triton: no data and no parameters for it
            assert result.get_output("OUTPUT0") == {"name": "OUTPUT0", "datatype": "FP32", "shape": [2, 16]}
        client.unregister_system_shared_memory(f"in-{protocol}")
        assert set(status_names(client, protocol)) == {f"out-{protocol}"}
        err = error_of(lambda: client.infer("add_sub_onnx", inputs, outputs=outputs))
        assert not_found(err, protocol) and f"in-{protocol}" in err.message()
    finally:
        client.unregister_system_shared_memory()
    assert status_names(client, protocol) == {}


def test_region_with_an_offset_and_bytes_tensors(server, regions):
    """A region registered at an offset into its object; BYTES in and out (length-prefixed, as Triton)."""
    client = make_client(server, "http")
    text = np.array([[b"hello", b"shared memory"]], dtype=np.object_)
    blob = serialize_byte_tensor(text).item()
    key, handle = regions(1024)
    shm.set_shared_memory_region(handle, [np.frombuffer(blob, np.uint8)], offset=100)
    client.register_system_shared_memory("text", key, 512, offset=100)
    client.register_system_shared_memory("answer", key, 400, offset=600)
    try:
        inp = httpclient.InferInput("TEXT", [1, 2], "BYTES")
        inp.set_shared_memory("text", len(blob))
        upper = httpclient.InferRequestedOutput("UPPER")
        upper.set_shared_memory("answer", 400)
        result = client.infer("string_py", [inp], outputs=[upper, httpclient.InferRequestedOutput("LENGTH")])
        assert result.get_output("UPPER") == {"name": "UPPER", "datatype": "BYTES", "shape": [1, 2]}
        expected = serialize_byte_tensor(np.array([[b"HELLO", b"SHARED MEMORY"]], dtype=np.object_)).item()
        raw = shm.get_contents_as_numpy(handle, np.uint8, [len(expected)], offset=600).tobytes()
        assert raw == expected
        assert result.as_numpy("LENGTH").tolist() == [[5, 13]]
    finally:
        client.unregister_system_shared_memory()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_regions_are_the_clients_error_naming_what(server, regions, protocol):
    client = make_client(server, protocol)
    key, handle = regions(256)
    small_key, _ = regions(64)

    err = error_of(lambda: client.register_system_shared_memory("nokey", "/azulite-no-such-key", 64))
    assert bad_arg(err, protocol) and "/azulite-no-such-key" in err.message()
    for evil in ("/../../etc/passwd", "/dev/null", "..", "/"):  # never a file outside /dev/shm
        err = error_of(lambda: client.register_system_shared_memory("evil", evil, 64))
        assert bad_arg(err, protocol) and "not a POSIX shared memory name" in err.message()
    err = error_of(lambda: client.register_system_shared_memory("big", small_key, 128))
    assert bad_arg(err, protocol) and "past the end" in err.message() and "big" in err.message()
    err = error_of(lambda: client.get_system_shared_memory_status("never-registered"))
    assert not_found(err, protocol) and "never-registered" in err.message()

    client.register_system_shared_memory("r", key, 256)
    try:
        err = error_of(lambda: client.register_system_shared_memory("r", key, 256))
        assert err.status() == ("400" if protocol == "http" else "StatusCode.ALREADY_EXISTS") and "'r' is already registered" in err.message()
        # unknown region, offset past the end, a byte size that is not the tensor's, an output too small
        inputs, outputs = shm_add_sub(protocol, "nowhere", "r")
        err = error_of(lambda: client.infer("add_sub_onnx", inputs, outputs=outputs))
        assert not_found(err, protocol) and "'nowhere'" in err.message() and "INPUT0" in err.message()
        inputs, outputs = shm_add_sub(protocol, "r", "r", offsets=(0, 200))
        err = error_of(lambda: client.infer("add_sub_onnx", inputs, outputs=outputs))
        assert bad_arg(err, protocol) and "offset 200" in err.message() and "'r'" in err.message()
        inputs, outputs = shm_add_sub(protocol, "r", "r", out_offsets=(0, 250))
        err = error_of(lambda: client.infer("add_sub_onnx", inputs, outputs=outputs))
        assert bad_arg(err, protocol) and "OUTPUT1" in err.message() and "offset 250" in err.message()
        m = lib(protocol)
        short = m.InferInput("INPUT0", [2, 16], "FP32")
        short.set_shared_memory("r", 100)
        other = m.InferInput("INPUT1", [2, 16], "FP32")
        other.set_shared_memory("r", 128)
        err = error_of(lambda: client.infer("add_sub_onnx", [short, other]))
        assert bad_arg(err, protocol) and "INPUT0" in err.message() and "needs 128" in err.message()
        small_out = m.InferRequestedOutput("OUTPUT0")
        small_out.set_shared_memory("r", 64)
        other.set_shared_memory("r", 128)
        short.set_shared_memory("r", 128, offset=128)
        err = error_of(lambda: client.infer("add_sub_onnx", [short, other], outputs=[small_out]))
        assert bad_arg(err, protocol) and "OUTPUT0" in err.message() and "128 bytes" in err.message()
        # and the server still serves
        client.infer("add_sub_onnx", [short, other], outputs=shm_add_sub(protocol, "r", "r")[1])
    finally:
        client.unregister_system_shared_memory("r")
    client.unregister_system_shared_memory("never-registered")  # as Triton: nothing to do is no error
    assert status_names(client, protocol) == {}


@pytest.mark.skipif(cuda_shm.available(), reason="this server has CUDA: tests/serve/test_cuda_shm.py")
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cuda_shared_memory_without_cuda_is_unimplemented_naming_what_is_missing(server, protocol):
    client = make_client(server, protocol)
    err = error_of(lambda: client.register_cuda_shared_memory("c", b"aGFuZGxl", 0, 64))
    assert err.status() == ("501" if protocol == "http" else "StatusCode.UNIMPLEMENTED")
    try:
        import cuda.bindings.runtime  # noqa: F401
    except ImportError:
        assert "CUDA Python bindings" in err.message() and "cuda-bindings" in err.message()
    else:
        assert "needs a CUDA device, and this server has none" in err.message()
    # nothing registered; the status of every kind stays empty, and the server metadata does not list it
    assert (client.get_cuda_shared_memory_status() if protocol == "http"
            else dict(client.get_cuda_shared_memory_status().regions)) in ([], {})
    extensions = (client.get_server_metadata()["extensions"] if protocol == "http"
                  else client.get_server_metadata().extensions)
    assert "system_shared_memory" in extensions and "cuda_shared_memory" not in extensions


def test_a_cuda_handle_in_libb64_lines_is_read_as_triton_reads_it():
    """perf_analyzer's C++ client base64-encodes the 64-byte handle with libb64: a newline every 72 characters
    (seen on a GPU machine: 'raw_handle.b64 is not base64' before)."""
    from azulite.serve.http import cuda_handle

    raw = bytes(range(64))
    text = base64.b64encode(raw).decode()
    assert cuda_handle("r", {"b64": text[:72] + "\n" + text[72:] + "\n"}) == raw


def test_a_malformed_cuda_registration_is_a_400_naming_the_field(server):
    conn = http.client.HTTPConnection(*server.http_url.split(":"), timeout=60)
    for body, says in (({"device_id": 0, "byte_size": 64}, "'raw_handle' must be {\"b64\""),
                       ({"raw_handle": "aGFuZGxl", "byte_size": 64}, "'raw_handle' must be {\"b64\""),
                       ({"raw_handle": {"b64": "not base64!"}, "byte_size": 64}, "raw_handle.b64 is not base64")):
        conn.request("POST", "/v2/cudasharedmemory/region/c/register", body=json.dumps(body))
        reply = conn.getresponse()
        assert reply.status == 400 and says in json.loads(reply.read())["error"], body
    conn.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_perf_analyzer_with_system_shared_memory(model_repository, tmp_path, protocol):
    assert PERF_ANALYZER.exists(), "perf_analyzer missing: `make test` installs it (scripts/anchors.sh)"
    data = tmp_path / "input.json"
    values = np.linspace(-1, 1, 256, dtype=np.float32).round(4).tolist()
    data.write_text(json.dumps({"data": [{"x": {"content": values, "shape": [256]}}]}))
    with running_server(model_repository) as s:
        url = s.http_url if protocol == "http" else s.grpc_url
        csv = tmp_path / "out.csv"
        p = subprocess.run([str(PERF_ANALYZER), "-m", "bench_matmul", "-i", protocol, "-u", url, "-b", "1",
                            "--shape", "x:256", "--input-data", str(data), "--concurrency-range", "2",
                            "--shared-memory", "system", "--output-shared-memory-size", "1024",
                            *COUNT_WINDOWS, "--max-trials", "5", "--stability-percentage", "999", "-f", str(csv)],
                           capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stdout + p.stderr
        header, row = (line.split(",") for line in csv.read_text().splitlines()[:2])
        assert float(row[header.index("Inferences/Second")]) > 0
        stats = httpclient.InferenceServerClient(s.http_url).get_inference_statistics("bench_matmul")
        assert stats["model_stats"][0]["inference_stats"]["success"]["count"] > 0
        assert "fail" not in stats["model_stats"][0]["inference_stats"] or \
            stats["model_stats"][0]["inference_stats"]["fail"]["count"] == 0


def shm_conversation(http_url: str, grpc_url: str, regions) -> dict:
    """The same shared-memory calls over both protocols; -> what a client sees (answers and error
    classes), to compare servers."""
    seen: dict = {}
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    y = rng.standard_normal((2, 16)).astype(np.float32)
    for protocol, url in (("http", http_url), ("grpc", grpc_url)):
        m = lib(protocol)
        client = m.InferenceServerClient(url)
        in_key, in_handle = regions(256)
        out_key, out_handle = regions(256)
        shm.set_shared_memory_region(in_handle, [x, y])
        client.register_system_shared_memory("in", in_key, 256)
        client.register_system_shared_memory("out", out_key, 256)  # Triton maps only page-aligned offsets
        try:
            seen[protocol, "status"] = sorted(status_names(client, protocol).items())
            inputs, outputs = shm_add_sub(protocol, "in", "out", out_offsets=(64, 0), batch=2)
            outputs[1].unset_shared_memory()
            result = client.infer("add_sub_py", inputs, outputs=outputs)
            seen[protocol, "OUTPUT0"] = shm.get_contents_as_numpy(out_handle, np.float32, [2, 16], offset=64).tolist()
            seen[protocol, "OUTPUT1"] = result.as_numpy("OUTPUT1").tolist()
            seen[protocol, "OUTPUT0 meta"] = (result.get_output("OUTPUT0") if protocol == "http" else
                                              str(result.get_output("OUTPUT0")))
            errors = {
                "twice": lambda: client.register_system_shared_memory("in", in_key, 256),
                "range": lambda: client.register_system_shared_memory("big", in_key, 512),
                "unknown": lambda: client.get_system_shared_memory_status("nowhere"),
                # outputs= by name: a third positional argument is the model's version (the client refused
                # the call itself before, and both servers "agreed" on an error neither sent)
                "region": lambda: client.infer("add_sub_py", shm_add_sub(protocol, "nowhere", "out")[0],
                                               outputs=shm_add_sub(protocol, "nowhere", "out")[1]),
                "offset": lambda: client.infer("add_sub_py", shm_add_sub(protocol, "in", "out", offsets=(0, 200))[0],
                                               outputs=outputs),
            }
            for what, call in errors.items():
                seen[protocol, what] = error_of(call).status()
                assert seen[protocol, what] is not None, f"{what}: the client refused the call, no server answered it"
        finally:
            client.unregister_system_shared_memory()
        seen[protocol, "after"] = status_names(client, protocol)
        client.close()
    return seen


def test_same_answers_as_real_triton(model_repository, tmp_path, regions):
    """tritonclient's shared-memory calls against azulite and against real Triton (Python backend):
    equal answers, equal error classes."""
    from .anchor import running_triton
    from .conftest import build_model_repository

    repo = build_model_repository(tmp_path / "repo", ("add_sub_py",))
    with running_triton(repo, tmp_path / "triton.log") as triton:
        theirs = shm_conversation(triton.http_url, triton.grpc_url, regions)
    with running_server(repo) as s:
        ours = shm_conversation(s.http_url, s.grpc_url, regions)
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal((2, 16)).astype(np.float32), rng.standard_normal((2, 16)).astype(np.float32)
    np.testing.assert_allclose(ours["grpc", "OUTPUT0"], x + y, rtol=1e-6)
    keys = {k[1] for k in ours}
    status = {k: v for k, v in ours.items() if k[1] == "status"}
    assert all(len(v) == 2 for v in status.values())  # keys differ by run; compare the rest of each region
    # Where Triton answers INTERNAL for a client's mistake (a range past the object's end), azulite
    # answers INVALID_ARGUMENT (a client's mistake is never a 500 here).
    assert ours["http", "range"] == "400" and ours["grpc", "range"] == "StatusCode.INVALID_ARGUMENT"
    diffs = []
    for k in ours:
        if k[1] == "status":
            if [(n, r[1:]) for n, r in ours[k]] != [(n, r[1:]) for n, r in theirs[k]]:
                diffs.append((k, ours[k], theirs[k]))
        elif k[1] != "range" and ours[k] != theirs[k]:
            diffs.append((k, ours[k], theirs[k]))
    assert not diffs
    assert {"twice", "range", "unknown", "region", "offset", "after", "OUTPUT0", "OUTPUT1"} <= keys



def test_a_region_unregistered_while_its_request_runs(regions):
    """The output region goes away between the request's check and the model's answer (the registry's
    own order of calls, as the data plane makes them): a 400 naming it, never a write to unmapped memory."""
    from azulite.errors import InvalidArgument
    from azulite.serve.shm import SharedMemory
    from azulite.serve.types import InferRequest, InferResponse, InferTensor, RequestedOutput

    registry = SharedMemory()
    key, handle = regions(64)
    registry.register("late", key, 0, 64)
    request = InferRequest("m", [], outputs=[RequestedOutput("y", {"shared_memory_region": "late",
                                                                   "shared_memory_byte_size": 8})])
    places = registry.output_places(request)
    answer = InferResponse("m", "1", [InferTensor("y", "FP32", (2,), np.array([1.5, 2.5], np.float32))])
    registry.unregister("late")
    with pytest.raises(InvalidArgument, match="'late' was unregistered while the request was running"):
        registry.place_outputs(answer, places)
    registry.register("late", key, 0, 64)  # registered again: the same request's answer lands
    registry.place_outputs(answer, registry.output_places(request))
    assert shm.get_contents_as_numpy(handle, np.float32, [2]).tolist() == [1.5, 2.5]
    registry.close()
    assert registry.status() == []
