"""CUDA shared memory (serve/cuda_shm.py) over HTTP and gRPC, on ``azulite serve`` and ``--workers 2``:
tritonclient's own cuda_shared_memory utilities (cudaMalloc + cudaIpcGetMemHandle in this process, the
server opening the handle in its own) and its clients, the bad inputs the issue names, perf_analyzer
``--shared-memory cuda``, and the same conversation against real Triton.

Needs a CUDA device and NVIDIA's CUDA Python bindings (cuda-bindings): skipped where there are none (CI
has no GPU; tests/serve/test_shm.py checks the 501 there). Run on a GPU machine with
``pytest tests/serve/test_cuda_shm.py``."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from contextlib import contextmanager

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from azulite.serve import cuda_shm

from .frontends import running_server
from .test_server import COUNT_WINDOWS, PERF_ANALYZER
from .test_shm import PROTOCOLS, error_of, lib, not_found

pytestmark = pytest.mark.skipif(not cuda_shm.available(), reason="needs a CUDA device and cuda-bindings "
                                "(tests/serve/test_shm.py checks the 501 without them)")


@pytest.fixture(scope="module")
def cudashm():
    import tritonclient.utils.cuda_shared_memory as module  # imports cuda.bindings: only where there is CUDA

    return module


@contextmanager
def serving(repo, kind: str):
    """(http url, grpc url) of ``azulite serve`` as ``--workers 1`` (``single``) or ``--workers 2``, in
    processes of their own: CUDA opens no IPC handle in the process that made it (the tests make them)."""
    from .test_workers import Workers

    w = Workers(repo, workers=1 if kind == "single" else 2)
    try:
        yield f"127.0.0.1:{w.ports['HTTPService']}", f"127.0.0.1:{w.ports['GRPCInferenceService']}"
    finally:
        w.stop()


@pytest.fixture(scope="module", params=["single", "workers"])
def server(request, model_repository):
    with serving(model_repository, request.param) as urls:
        yield urls


@pytest.fixture
def regions(cudashm):
    """Creates CUDA regions on device 0; destroys them after the test."""
    made = []

    def create(size: int, name: str = "r"):
        handle = cudashm.create_shared_memory_region(name, size, 0)
        made.append(handle)
        return handle

    yield create
    for handle in made:
        cudashm.destroy_shared_memory_region(handle)


def client_of(urls, protocol: str):
    return (httpclient.InferenceServerClient(urls[0], network_timeout=120) if protocol == "http"
            else grpcclient.InferenceServerClient(urls[1]))


def cuda_status(client, protocol: str) -> dict[str, tuple[int, int]]:
    if protocol == "http":
        return {r["name"]: (int(r["device_id"]), int(r["byte_size"])) for r in client.get_cuda_shared_memory_status()}
    return {n: (r.device_id, r.byte_size) for n, r in client.get_cuda_shared_memory_status().regions.items()}


def add_sub(protocol, in_region, out_region, offsets=(0, 128), out_offsets=(0, 128)):
    m = lib(protocol)
    inputs = [m.InferInput(n, [2, 16], "FP32") for n in ("INPUT0", "INPUT1")]
    for i, off in zip(inputs, offsets):
        i.set_shared_memory(in_region, 128, offset=off)
    outputs = [m.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
    for o, off in zip(outputs, out_offsets):
        o.set_shared_memory(out_region, 128, offset=off)
    return inputs, outputs


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_infer_with_inputs_and_outputs_in_cuda_shared_memory(server, regions, cudashm, protocol):
    client = client_of(server, protocol)
    rng = np.random.default_rng(3)
    x, y = (rng.standard_normal((2, 16)).astype(np.float32) for _ in range(2))
    src, dst = regions(256, "in"), regions(256, "out")
    cudashm.set_shared_memory_region(src, [x, y])
    client.register_cuda_shared_memory(f"in-{protocol}", cudashm.get_raw_handle(src), 0, 256)
    client.register_cuda_shared_memory(f"out-{protocol}", cudashm.get_raw_handle(dst), 0, 256)
    try:
        assert cuda_status(client, protocol) == {f"in-{protocol}": (0, 256), f"out-{protocol}": (0, 256)}
        inputs, outputs = add_sub(protocol, f"in-{protocol}", f"out-{protocol}")
        client.infer("add_sub_onnx", inputs, outputs=outputs)
        got = cudashm.get_contents_as_numpy(dst, np.float32, [4, 16])
        np.testing.assert_allclose(got[:2], x + y, rtol=1e-6)
        np.testing.assert_allclose(got[2:], x - y, rtol=1e-6)
        # the client rewrites its input region on the GPU: the next answer follows
        cudashm.set_shared_memory_region(src, [y, x])
        client.infer("add_sub_onnx", inputs, outputs=outputs)
        np.testing.assert_allclose(cudashm.get_contents_as_numpy(dst, np.float32, [4, 16])[2:], y - x, rtol=1e-6)
        # mixed: one input and one output in the body
        m = lib(protocol)
        body_in = m.InferInput("INPUT1", [2, 16], "FP32")
        body_in.set_data_from_numpy(x)
        result = client.infer("add_sub_onnx", [inputs[0], body_in], outputs=[outputs[0], m.InferRequestedOutput("OUTPUT1")])
        np.testing.assert_allclose(cudashm.get_contents_as_numpy(dst, np.float32, [2, 16]), y + x, rtol=1e-6)
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), y - x, rtol=1e-6)
        # the two kinds are one namespace, but each kind's status and unregister see only their own
        system = client.get_system_shared_memory_status()
        assert system == [] if protocol == "http" else not system.regions
        client.unregister_system_shared_memory(f"in-{protocol}")  # a CUDA region: untouched
        assert set(cuda_status(client, protocol)) == {f"in-{protocol}", f"out-{protocol}"}
        client.unregister_cuda_shared_memory(f"in-{protocol}")
        assert set(cuda_status(client, protocol)) == {f"out-{protocol}"}
        err = error_of(lambda: client.infer("add_sub_onnx", inputs, outputs=outputs))
        assert not_found(err, protocol) and f"in-{protocol}" in err.message()
    finally:
        client.unregister_cuda_shared_memory()
    assert cuda_status(client, protocol) == {}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_cuda_regions_are_the_clients_error_naming_what(server, regions, cudashm, protocol):
    client = client_of(server, protocol)
    bad = "400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"
    region = regions(256)
    handle = cudashm.get_raw_handle(region)
    # more bytes than the allocation holds: refused at registration, never read past
    err = error_of(lambda: client.register_cuda_shared_memory("big", handle, 0, 1 << 20))
    assert err.status() == bad and "past the end of the allocation" in err.message(), err.message()
    err = error_of(lambda: client.register_cuda_shared_memory("dev", handle, 99, 256))
    assert err.status() == bad and "device_id 99 does not exist" in err.message(), err.message()
    junk = base64.b64encode(os.urandom(64))
    err = error_of(lambda: client.register_cuda_shared_memory("junk", junk, 0, 256))
    assert err.status() == bad and "unable to open its CUDA IPC handle" in err.message(), err.message()
    short = base64.b64encode(b"0123456789")
    err = error_of(lambda: client.register_cuda_shared_memory("short", short, 0, 256))
    assert err.status() == bad and "64-byte" in err.message() and "got 10 bytes" in err.message()
    err = error_of(lambda: client.get_cuda_shared_memory_status("nowhere"))
    assert not_found(err, protocol) and "nowhere" in err.message()
    client.register_cuda_shared_memory("r", handle, 0, 256)
    try:
        err = error_of(lambda: client.register_cuda_shared_memory("r", handle, 0, 256))
        assert err.status() in ("400", "StatusCode.ALREADY_EXISTS") and "'r' is already registered" in err.message()
        inputs, outputs = add_sub(protocol, "r", "r", offsets=(0, 200))
        err = error_of(lambda: client.infer("add_sub_onnx", inputs, outputs=outputs))
        assert err.status() == bad and "INPUT1" in err.message() and "past the end" in err.message()
        # and the server still serves
        cudashm.set_shared_memory_region(region, [np.ones((4, 16), np.float32)])
        inputs, outputs = add_sub(protocol, "r", "r")
        client.infer("add_sub_onnx", inputs, outputs=outputs)
        assert cudashm.get_contents_as_numpy(region, np.float32, [2, 16]).tolist() == [[2.0] * 16] * 2
    finally:
        client.unregister_cuda_shared_memory()
    assert cuda_status(client, protocol) == {}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_perf_analyzer_with_cuda_shared_memory(model_repository, tmp_path, protocol):
    assert PERF_ANALYZER.exists(), "perf_analyzer missing: `make test` installs it (scripts/anchors.sh)"
    data = tmp_path / "input.json"
    values = np.linspace(-1, 1, 256, dtype=np.float32).round(4).tolist()
    data.write_text(json.dumps({"data": [{"x": {"content": values, "shape": [256]}}]}))
    with running_server(model_repository) as s:
        csv = tmp_path / "out.csv"
        p = subprocess.run([str(PERF_ANALYZER), "-m", "bench_matmul", "-i", protocol, "-u",
                            s.http_url if protocol == "http" else s.grpc_url, "-b", "1", "--shape", "x:256",
                            "--input-data", str(data), "--concurrency-range", "2", "--shared-memory", "cuda",
                            "--output-shared-memory-size", "1024", *COUNT_WINDOWS, "--max-trials", "5",
                            "--stability-percentage", "999", "-f", str(csv)], capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stdout + p.stderr
        header, row = (line.split(",") for line in csv.read_text().splitlines()[:2])
        assert float(row[header.index("Inferences/Second")]) > 0
        stats = httpclient.InferenceServerClient(s.http_url).get_inference_statistics("bench_matmul")
        assert stats["model_stats"][0]["inference_stats"]["success"]["count"] > 0
        assert stats["model_stats"][0]["inference_stats"].get("fail", {}).get("count", 0) == 0


def conversation(http_url: str, grpc_url: str, cudashm, regions) -> dict:
    """The same CUDA shared-memory calls over both protocols; -> answers and error classes, to compare servers."""
    seen: dict = {}
    rng = np.random.default_rng(11)
    x, y = (rng.standard_normal((2, 16)).astype(np.float32) for _ in range(2))
    for protocol, url in (("http", http_url), ("grpc", grpc_url)):
        client = lib(protocol).InferenceServerClient(url)
        src, dst = regions(256, "in"), regions(256, "out")
        cudashm.set_shared_memory_region(src, [x, y])
        client.register_cuda_shared_memory("in", cudashm.get_raw_handle(src), 0, 256)
        client.register_cuda_shared_memory("out", cudashm.get_raw_handle(dst), 0, 256)
        try:
            seen[protocol, "status"] = sorted(cuda_status(client, protocol).items())
            inputs, outputs = add_sub(protocol, "in", "out", out_offsets=(128, 0))
            outputs[1].unset_shared_memory()
            result = client.infer("add_sub_py", inputs, outputs=outputs)
            seen[protocol, "OUTPUT0"] = cudashm.get_contents_as_numpy(dst, np.float32, [4, 16])[2:].tolist()
            seen[protocol, "OUTPUT1"] = result.as_numpy("OUTPUT1").tolist()
            seen[protocol, "OUTPUT0 meta"] = (result.get_output("OUTPUT0") if protocol == "http" else
                                              str(result.get_output("OUTPUT0")))
            errors = {
                "twice": lambda: client.register_cuda_shared_memory("in", cudashm.get_raw_handle(src), 0, 256),
                "unknown": lambda: client.get_cuda_shared_memory_status("nowhere"),
                # outputs= by name: a third positional argument is the model's version
                "region": lambda: client.infer("add_sub_py", add_sub(protocol, "nowhere", "out")[0],
                                               outputs=add_sub(protocol, "nowhere", "out")[1]),
                "offset": lambda: client.infer("add_sub_py", add_sub(protocol, "in", "out", offsets=(0, 200))[0],
                                               outputs=outputs),
            }
            for what, call in errors.items():
                seen[protocol, what] = error_of(call).status()
                assert seen[protocol, what] is not None, f"{what}: the client refused the call, no server answered it"
        finally:
            client.unregister_cuda_shared_memory()
        seen[protocol, "after"] = cuda_status(client, protocol)
        client.close()
    return seen


def test_same_answers_as_real_triton(tmp_path, regions, cudashm):
    """tritonclient's CUDA shared-memory calls against azulite and against real Triton (Python backend):
    equal answers, equal error classes."""
    from .anchor import running_triton
    from .conftest import build_model_repository

    repo = build_model_repository(tmp_path / "repo", ("add_sub_py",))
    with running_triton(repo, tmp_path / "triton.log") as triton:
        theirs = conversation(triton.http_url, triton.grpc_url, cudashm, regions)
    with serving(repo, "single") as (http_url, grpc_url):
        ours = conversation(http_url, grpc_url, cudashm, regions)
    rng = np.random.default_rng(11)
    x, y = (rng.standard_normal((2, 16)).astype(np.float32) for _ in range(2))
    np.testing.assert_allclose(ours["grpc", "OUTPUT0"], x + y, rtol=1e-6)
    assert ours == theirs
