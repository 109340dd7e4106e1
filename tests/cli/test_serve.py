"""``azulite serve`` through the real console script: the startup table and endpoints, Triton's clients
talking to it, SIGTERM draining in-flight requests before a clean exit, bad flags without tracebacks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.serve.conftest import build_model_repository

AZULITE = str(Path(sys.executable).parent / "azulite")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return build_model_repository(tmp_path_factory.mktemp("cli_repo"), ("add_sub_onnx", "slow_py", "string_py"))


class Served:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [AZULITE, "serve", *args, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
             "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"})
        self.lines: list[str] = []
        self.ports: dict[str, int] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and "ready" not in self.ports:
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        assert "ready" in self.ports, "".join(self.lines)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.match(r"Started (\w+)(?: Service)? at [\d.]+:(\d+)", line)
            if m:
                self.ports[m.group(1)] = int(m.group(2))
            if "azulite serve ready" in line:
                self.ports["ready"] = 1

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(60)
        self._reader.join(10)


def test_serve_prints_table_and_serves_both_protocols(repo):
    s = Served(str(repo))
    try:
        text = "".join(s.lines)
        for name in ("add_sub_onnx", "slow_py", "string_py"):
            assert re.search(rf"{name}\s*│\s*1\s*│\s*READY", text), text
        assert {"HTTPService", "GRPCInferenceService", "Metrics"} <= set(s.ports)
        x = np.ones((1, 16), np.float32)
        h = httpclient.InferenceServerClient(f"127.0.0.1:{s.ports['HTTPService']}")
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{s.ports['GRPCInferenceService']}")
        try:
            for module, client in ((httpclient, h), (grpcclient, g)):
                inputs = []
                for n in ("INPUT0", "INPUT1"):
                    i = module.InferInput(n, [1, 16], "FP32")
                    i.set_data_from_numpy(x)
                    inputs.append(i)
                np.testing.assert_array_equal(client.infer("add_sub_onnx", inputs).as_numpy("OUTPUT0"), 2 * x)
        finally:
            h.close()
            g.close()
    finally:
        s.stop()


def test_sigterm_drains_in_flight_requests(repo):
    s = Served(str(repo), "--model-repository", str(repo), "--grpc-impl", "grpcio")
    results: dict[int, object] = {}
    try:
        url = f"127.0.0.1:{s.ports['HTTPService']}"

        def call(k):
            c = httpclient.InferenceServerClient(url, network_timeout=120)
            i = httpclient.InferInput("INPUT0", [1, 1], "FP32")
            i.set_data_from_numpy(np.full((1, 1), k, np.float32))
            try:
                results[k] = float(c.infer("slow_py", [i]).as_numpy("OUTPUT0")[0, 0])
            except Exception as exc:  # noqa: BLE001 - asserted below
                results[k] = exc
            finally:
                c.close()

        threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        metrics = f"http://127.0.0.1:{s.ports['Metrics']}/metrics"

        def received() -> float:  # answered + queued, from Triton's metrics
            import urllib.request

            from prometheus_client.parser import text_string_to_metric_families
            text = urllib.request.urlopen(metrics, timeout=30).read().decode()
            total = 0.0
            for family in text_string_to_metric_families(text):
                if family.name in ("nv_inference_request_success", "nv_inference_pending_request_count"):
                    total += sum(x.value for x in family.samples if x.labels.get("model") == "slow_py")
            return total

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and received() < 3:
            time.sleep(0.01)
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert s.proc.wait(120) == 0
        assert sorted(results) == [0, 1, 2, 3], results
        # slow_py echoes: each answer is its own request's value, never another's
        answered = {k: r for k, r in results.items() if not isinstance(r, Exception)}
        assert len(answered) >= 3 and all(r == float(k) for k, r in answered.items()), results
        # one that had not reached the server when it stopped is refused (the listener was closed)
        refused = [r for r in results.values() if isinstance(r, Exception)]
        assert all(isinstance(r, ConnectionError) or "shutting down" in str(r) for r in refused), refused
        out = "".join(s.lines)
        assert "SIGTERM: draining" in out and "azulite serve stopped" in out
    finally:
        s.stop()


@pytest.mark.parametrize(("args", "message"), [
    (["/no/such/repository"], "not a directory"),
    (["{repo}", "--model-control-mode", "sometimes"], "--model-control-mode"),
    (["{repo}", "--load-model", "add_sub_onnx"], "explicit"),
    (["{repo}", "--http-port", "70000"], "not a port"),
    (["{repo}", "--grpc-impl", "fast"], "--grpc-impl"),
])
def test_bad_flags_exit_2_without_traceback(repo, args, message):
    p = subprocess.run([AZULITE, "serve", *(a.format(repo=repo) for a in args)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr and "Traceback" not in p.stderr
