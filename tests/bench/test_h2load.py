"""bench/h2load.py against a real ``azulite serve``: h2load's requests (KServe v2 HTTP with the binary tensor
extension, gRPC ModelInfer over h2) are answered as inferences by the server, every one counted, and the
figures are read from h2load's own summary and log; a request the server refuses counts as failed."""

from __future__ import annotations

import json
import shutil
import urllib.request

import numpy as np
import pytest

from bench import h2load
from tests.cli.test_serve import Served
from tests.serve.conftest import build_model_repository

pytestmark = pytest.mark.skipif(shutil.which("h2load") is None,
                                reason="h2load is not installed (scripts/install.sh --dev: apt-get install nghttp2-client)")


def successes(http_port: int, model: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/{model}/stats", timeout=30) as r:
        return int(json.loads(r.read())["model_stats"][0]["inference_stats"]["success"]["count"])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = build_model_repository(tmp_path_factory.mktemp("h2load") / "repo", ("bench_matmul",))
    s = Served(str(repo))
    yield s
    s.stop()


@pytest.mark.parametrize("protocol,concurrency", [("http", 3), ("grpc", 4), ("grpc", 1)])
def test_every_h2load_request_is_an_inference_the_server_answers(served, tmp_path, protocol, concurrency):
    x = np.random.default_rng(0).uniform(-1, 1, (1, 256)).astype(np.float32)
    body = h2load.bodies(tmp_path, "bench_matmul", {"x": x})[protocol]
    http_port = served.ports["HTTPService"]
    port = http_port if protocol == "http" else served.ports["GRPCInferenceService"]
    before = successes(http_port, "bench_matmul")
    r = h2load.run("bench_matmul", protocol, port, concurrency, body, tmp_path, requests=40)
    assert "error" not in r, r
    assert (r["done"], r["failed"]) == (40, 0)
    assert successes(http_port, "bench_matmul") - before == 40  # each one a real inference, none refused
    assert r["infer_per_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"]


def test_a_request_the_server_refuses_counts_as_failed(served, tmp_path):
    x = np.zeros((1, 255), np.float32)  # the model takes [256] per row: a 400 over HTTP
    body = h2load.bodies(tmp_path, "bench_matmul", {"x": x})["http"]
    r = h2load.run("bench_matmul", "http", served.ports["HTTPService"], 2, body, tmp_path, requests=10)
    assert "10 done, 10 failed" in r.get("error", ""), r  # no figures from answers that were refusals


def test_the_summary_and_log_are_read_as_h2load_prints_them(tmp_path):
    log = tmp_path / "log"
    log.write_text("".join(f"1795583877889{i:03d}\t200\t{1000 + 10 * i}\n" for i in range(100)) + "1795583877890000\t503\t5\n")
    out = ("finished in 3.00s, 2011.33 req/s, 10.04MB/s\n"
           "requests: 101 total, 101 started, 101 done, 100 succeeded, 1 failed, 0 errored, 0 timeout\n")
    r = h2load.parse(out, log)
    assert r["infer_per_s"] == 2011.3 and r["done"] == 101 and r["failed"] == 1
    assert r["p50_ms"] == pytest.approx(1.495) and r["p99_ms"] == pytest.approx(1.98, abs=0.001)
    assert "error" in h2load.parse("nothing useful", log)


@pytest.mark.parametrize("json_inputs,binary_outputs", [(True, False), (False, False), (True, True)])
def test_json_tensor_bodies_are_inferences_answered_as_asked(served, tmp_path, json_inputs, binary_outputs):
    x = np.random.default_rng(1).uniform(-1, 1, (1, 256)).astype(np.float32)
    body = h2load.bodies(tmp_path, "bench_matmul", {"x": x}, binary_outputs=binary_outputs, json_inputs=json_inputs)["http"]
    http_port = served.ports["HTTPService"]
    # the very body and headers h2load sends, answered as asked: JSON numbers or binary outputs
    headers = dict(h.split(": ", 1) for h in body.headers)
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/models/bench_matmul/infer",
                                 data=body.path.read_bytes(), headers=headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        answered = r.read()
        header_length = r.headers.get("Inference-Header-Content-Length")
    assert (header_length is None) == (not binary_outputs)
    if not binary_outputs:
        out = json.loads(answered)["outputs"][0]
        assert out["shape"] == [1, 256] and len(out["data"]) == 256
    before = successes(http_port, "bench_matmul")
    r = h2load.run("bench_matmul", "http", http_port, 2, body, tmp_path, requests=30)
    assert "error" not in r, r
    assert (r["done"], r["failed"]) == (30, 0) and successes(http_port, "bench_matmul") - before == 30
