"""The whole server: model control over both protocols (explicit load/unload, poll), broken models that
never stop the others, graceful drain of in-flight requests, and perf_analyzer (Triton's own load tool)
driving it over HTTP and gRPC."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .frontends import running_server

REPO_ROOT = Path(__file__).resolve().parents[2]


def fp32_inputs(module, x, names=("INPUT0", "INPUT1")):
    out = []
    for name in names:
        i = module.InferInput(name, list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        out.append(i)
    return out


def wait_for(predicate, timeout=60.0, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def test_explicit_mode_load_unload_over_http_and_grpc(repository_copy):
    with running_server(repository_copy, model_control_mode="explicit", load_models=("add_sub_onnx",)) as s:
        h = httpclient.InferenceServerClient(s.http_url)
        g = grpcclient.InferenceServerClient(s.grpc_url)
        try:
            assert h.is_model_ready("add_sub_onnx")
            assert not h.is_model_ready("add_sub_py")
            index = {m["name"]: m for m in h.get_model_repository_index()}
            assert "add_sub_py" in index and index["add_sub_py"].get("state", "") != "READY"
            x = np.ones((1, 16), np.float32)
            err = pytest.raises(InferenceServerException, h.infer, "add_sub_py", fp32_inputs(httpclient, x))
            # not loaded in explicit mode: unknown to the server, NOT_FOUND ("... is not found")
            assert err.value.status() == "404" and "'add_sub_py' is not found" in err.value.message(), err.value

            h.load_model("add_sub_py")
            assert h.is_model_ready("add_sub_py")
            np.testing.assert_array_equal(h.infer("add_sub_py", fp32_inputs(httpclient, x)).as_numpy("OUTPUT0"), 2 * x)
            h.unload_model("add_sub_py")
            assert wait_for(lambda: not h.is_model_ready("add_sub_py"))

            g.load_model("string_py")
            assert g.is_model_ready("string_py")
            g.unload_model("string_py")
            assert wait_for(lambda: not g.is_model_ready("string_py"))

            # a config override through the load API (Triton's "config" parameter)
            config = json.dumps({"name": "add_sub_onnx", "platform": "onnxruntime_onnx", "max_batch_size": 4,
                                 "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]},
                                           {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [16]}],
                                 "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [16]},
                                            {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [16]}]})
            h.load_model("add_sub_onnx", config=config)
            assert h.get_model_config("add_sub_onnx")["max_batch_size"] == 4

            # model files sent with the load request (base64 over HTTP, bytes over gRPC)
            onnx = (repository_copy / "add_sub_onnx" / "1" / "model.onnx").read_bytes()
            for client, name in ((h, "sent_over_http"), (g, "sent_over_grpc")):
                client.load_model(name, config=config.replace('"add_sub_onnx"', f'"{name}"'),
                                  files={"file:1/model.onnx": onnx})
                assert client.is_model_ready(name)
            np.testing.assert_array_equal(
                h.infer("sent_over_grpc", fp32_inputs(httpclient, x)).as_numpy("OUTPUT0"), 2 * x)

            err = pytest.raises(InferenceServerException, h.load_model, "no_such_model")
            assert err.value.status().startswith("4") and "no_such_model" in err.value.message()
            err = pytest.raises(InferenceServerException, g.load_model, "no_such_model")
            assert err.value.status() == "StatusCode.NOT_FOUND"
        finally:
            h.close()
            g.close()


def test_load_api_refused_in_none_mode(model_repository):
    with running_server(model_repository) as s:
        h = httpclient.InferenceServerClient(s.http_url)
        try:
            err = pytest.raises(InferenceServerException, h.unload_model, "add_sub_onnx")
            assert err.value.status() == "503" and "explicit" in err.value.message()  # as Triton answers
            assert h.is_model_ready("add_sub_onnx")
        finally:
            h.close()


def test_broken_models_fail_alone(broken_model_repository):
    with running_server(broken_model_repository, model_control_mode="explicit",
                        load_models=("add_sub_onnx",)) as s:
        h = httpclient.InferenceServerClient(s.http_url)
        g = grpcclient.InferenceServerClient(s.grpc_url)
        try:
            for name in ("broken_onnx", "broken_config"):
                err = pytest.raises(InferenceServerException, h.load_model, name)
                assert err.value.status() == "400", err.value
                assert name in err.value.message()
                err = pytest.raises(InferenceServerException, g.load_model, name)
                assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
            index = {m["name"]: m for m in h.get_model_repository_index()}
            assert index["broken_onnx"]["state"] == "UNAVAILABLE" and index["broken_onnx"]["reason"]
            x = np.ones((1, 16), np.float32)
            err = pytest.raises(InferenceServerException, h.infer, "broken_onnx", fp32_inputs(httpclient, x, ("x",)))
            assert err.value.status() == "404" and "no available versions" in err.value.message(), err.value  # as Triton
            np.testing.assert_array_equal(
                h.infer("add_sub_onnx", fp32_inputs(httpclient, x)).as_numpy("OUTPUT0"), 2 * x)
            np.testing.assert_array_equal(
                g.infer("add_sub_onnx", fp32_inputs(grpcclient, x)).as_numpy("OUTPUT0"), 2 * x)
        finally:
            h.close()
            g.close()


def test_poll_mode_picks_up_a_new_model(repository_copy):
    with running_server(repository_copy, model_control_mode="poll", repository_poll_secs=0.3) as s:
        h = httpclient.InferenceServerClient(s.http_url)
        try:
            assert not h.is_model_ready("add_sub_copy")
            shutil.copytree(repository_copy / "add_sub_onnx", repository_copy / "add_sub_copy.tmp")
            cfg = repository_copy / "add_sub_copy.tmp" / "config.pbtxt"
            cfg.write_text(cfg.read_text().replace('name: "add_sub_onnx"', 'name: "add_sub_copy"'))
            os.rename(repository_copy / "add_sub_copy.tmp", repository_copy / "add_sub_copy")
            assert wait_for(lambda: h.is_model_ready("add_sub_copy"), timeout=90)
            x = np.ones((1, 16), np.float32)
            np.testing.assert_array_equal(
                h.infer("add_sub_copy", fp32_inputs(httpclient, x)).as_numpy("OUTPUT1"), 0 * x)
        finally:
            h.close()


def test_graceful_drain_answers_in_flight_requests(model_repository):
    """slow_py takes 0.2 s per execution, one at a time: several requests are queued when stop begins;
    every one of them is answered, over both protocols, and the listeners are closed."""
    with running_server(model_repository) as s:
        results: list = []
        lock = threading.Lock()
        barrier = threading.Barrier(6, timeout=120)

        def call(kind, k):
            x = np.full((1, 1), k, np.float32)
            try:
                if kind == "http":
                    c = httpclient.InferenceServerClient(s.http_url, network_timeout=120)
                    assert c.is_server_live()  # connected before the burst
                    barrier.wait()
                    out = c.infer("slow_py", fp32_inputs(httpclient, x, ("INPUT0",))).as_numpy("OUTPUT0")
                else:
                    c = grpcclient.InferenceServerClient(s.grpc_url)
                    assert c.is_server_live()
                    barrier.wait()
                    out = c.infer("slow_py", fp32_inputs(grpcclient, x, ("INPUT0",))).as_numpy("OUTPUT0")
                c.close()
                with lock:
                    results.append((k, float(out.reshape(-1)[0])))
            except Exception as exc:  # noqa: BLE001 - recorded and asserted on below
                with lock:
                    results.append((k, exc))

        threads = [threading.Thread(target=call, args=("http" if k % 2 else "grpc", k)) for k in range(6)]
        for t in threads:
            t.start()
        # wait until the requests are in the server (queued or executing), then stop it
        dp = s.server.dataplane
        assert wait_for(lambda: dp.manager.get("slow_py").stats.success.count + dp._inflight >= 6,
                        timeout=60, interval=0.005)
        assert dp._inflight >= 2  # some are still queued behind the 0.2 s executions
        s.call(s.server.stop(30), timeout=120)
        for t in threads:
            t.join(120)
        assert sorted(results, key=lambda r: r[0]) == [(k, float(k)) for k in range(6)]
        with pytest.raises(ConnectionRefusedError):  # the listener is closed
            httpclient.InferenceServerClient(s.http_url, connection_timeout=5).is_server_live()


PERF_ANALYZER = REPO_ROOT / ".cache" / "anchors" / "bin" / "perf_analyzer"  # scripts/anchors.sh
#: perf_analyzer's windows for the functional runs: each ends after 50 requests, not after a time, so none is
#: empty on a loaded machine. A CI run's sequence test failed "Failed to obtain stable measurement" with 1 s
#: windows at --stability-percentage 999, which three windows with requests always pass; an empty (invalid)
#: window is the one way left, not reproduced here (5 runs beside two busy loops passed)
COUNT_WINDOWS = ("--measurement-mode", "count_windows", "--measurement-request-count", "50")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_drives_the_server(model_repository, tmp_path, protocol):
    assert PERF_ANALYZER.exists(), "perf_analyzer missing: `make test` installs it (scripts/anchors.sh)"
    pa = PERF_ANALYZER
    data = tmp_path / "input.json"
    values = np.linspace(-1, 1, 256, dtype=np.float32).round(4).tolist()
    data.write_text(json.dumps({"data": [{"x": {"content": values, "shape": [256]}}]}))
    with running_server(model_repository) as s:
        url = s.http_url if protocol == "http" else s.grpc_url
        csv = tmp_path / "out.csv"
        p = subprocess.run([str(pa), "-m", "bench_matmul", "-i", protocol, "-u", url, "-b", "1",
                            "--shape", "x:256", "--input-data", str(data), "--concurrency-range", "4",
                            *COUNT_WINDOWS, "--max-trials", "5", "--stability-percentage", "999", "-f", str(csv)],
                           capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stdout + p.stderr
        lines = csv.read_text().splitlines()
        header, row = lines[0].split(","), lines[1].split(",")
        assert float(row[header.index("Inferences/Second")]) > 0
        stats = httpclient.InferenceServerClient(s.http_url).get_inference_statistics("bench_matmul")
        assert stats["model_stats"][0]["inference_stats"]["success"]["count"] > 0


def test_the_exit_timeout_is_one_budget_for_the_whole_stop(tmp_path):
    """A request stuck in a model: the front-ends wait for it up to the timeout, and the data plane's own
    drain gets what is left of that one budget (it got the whole timeout again: 70 s to stop at the default
    30). The data plane's shutdown is wrapped to see the budget it is given, and when."""
    from .conftest import Gate
    from .frontends import ServerThread

    with Gate(tmp_path) as gate:
        server = ServerThread(gate.repository).start()
        dp = server.server.dataplane
        given: list[tuple[float, float]] = []
        shutdown = dp.shutdown

        async def watched(timeout_s: float = 30.0) -> None:
            given.append((timeout_s, time.monotonic()))
            await shutdown(timeout_s)

        dp.shutdown = watched
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=300)
        i = httpclient.InferInput("INPUT0", [1], "FP32")
        i.set_data_from_numpy(np.ones(1, np.float32))
        def call():
            try:
                client.infer("gate_py", [i])
            except Exception:  # noqa: BLE001 - never answered: the server stops without it
                pass

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        assert gate.entered(1)
        began = time.monotonic()
        server.stop(drain_timeout_s=2.0)
        (budget, at), = given
        # the front-ends held the stuck request until the deadline: what the data plane got is what was left
        assert budget <= 2.0 - (at - began) + 0.05, (budget, at - began)
        client.close()
