"""``azulite serve`` through the real console script: the startup table and endpoints, Triton's clients
talking to it, SIGTERM draining in-flight requests before a clean exit, bad flags without tracebacks."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.serve.conftest import Gate, add_broken_models, build_model_repository
from tests.serve.test_hostile import read_until_closed

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
            if "azulite serve ready" in line or "azulite serve started but NOT ready" in line:
                self.ports["ready"] = 1

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(60)
        self._reader.join(10)


def test_serve_prints_table_and_serves_both_protocols(repo):
    s = Served(str(repo), "--max-header-bytes", "8192", "--max-connections", "64")
    try:
        # the connection-limit flags reach the server: a request head past 8 KiB answers 431
        sock = socket.create_connection(("127.0.0.1", s.ports["HTTPService"]), timeout=60)
        sock.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 431")
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


def test_sigterm_drains_in_flight_requests(repo, tmp_path):
    audit = tmp_path / "audit.jsonl"
    s = Served(str(repo), "--model-repository", str(repo), "--grpc-impl", "grpcio", "--audit-log", str(audit))
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
        # the audit log lost no line on the way out: one per answered request
        lines = [json.loads(x) for x in audit.read_text().splitlines()]
        assert len([x for x in lines if x["model"] == "slow_py" and x["status"] == 200]) == len(answered), lines
    finally:
        s.stop()


@pytest.mark.parametrize(("args", "message"), [
    (["/no/such/repository"], "does not exist"),
    (["{repo}", "--model-control-mode", "sometimes"], "--model-control-mode"),
    (["{repo}", "--load-model", "add_sub_onnx"], "explicit"),
    (["{repo}", "--http-port", "70000"], "not a port"),
    (["{repo}", "--grpc-impl", "fast"], "--grpc-impl"),
    (["{repo}", "--max-concurrent-streams", "0"], "--max-concurrent-streams: must be a whole number of at least 1"),
    (["{repo}", "--header-timeout-secs", "-2"], "--header-timeout-secs: must be a positive number of seconds"),
    (["{repo}", "--grpc-impl", "grpcio", "--max-control-frames", "50"], "grpcio cannot enforce --max-control-frames"),
    (["{repo}", "--log-verbose", "-1"], "--log-verbose: must be 0 or more"),
    (["{repo}", "--log-format", "iso"], "--log-format: must be one of default, ISO8601"),
    (["{repo}", "--log-info", "maybe"], "--log-info"),
])
def test_bad_flags_exit_2_without_traceback(repo, args, message):
    p = subprocess.run([AZULITE, "serve", *(a.format(repo=repo) for a in args)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["--http-port", "70000"], "error: --http-port: 70000 is not a port (0-65535)\n  fix: e.g. --http-port 0"),
    (["--http-port", "47001", "--grpc-port", "47001"], "error: --grpc-port: --http-port and --grpc-port are both 47001"),
    (["--grpc-address", "no such host"], "error: --grpc-address: cannot listen on 'no such host'"),
    (["--exit-timeout-secs", "-1"], "error: --exit-timeout-secs: must be >= 0 seconds, got -1\n  fix:"),
    (["--allow-http", "false", "--allow-grpc", "false"],
     "error: --allow-grpc: with --allow-http false too, no endpoint would take an inference request"),
    (["--allow-http", "maybe"], "error: --allow-http: takes true or false, got 'maybe'\n  fix: e.g. --allow-http false"),
    (["--load-model", "add_sub_onnx"], "error: --load-model: needs --model-control-mode explicit\n  fix:"),
    (["--repository-poll-secs", "0"], "error: --repository-poll-secs: must be positive, got 0\n  fix:"),
    (["--model-repository", "/elsewhere"], "error: REPOSITORY: two repositories given"),
    (["--key-store", "/tmp/keys.db"], "error: --key-store: is only read with --auth\n  fix: add --auth"),
    (["--auth", "--key-store", "/"], "error: --key-store: key store '/' is a directory"),
    (["--audit-log", "/"], "error: / (--audit-log): is a directory"),  # served, every audit line lost
    (["--audit-log", "/proc/nope/a.jsonl"], "error: /proc/nope/a.jsonl (--audit-log): its folder cannot be made"),
    (["--audit-log", "/proc/a.jsonl"], "error: /proc/a.jsonl (--audit-log): cannot be written: "),  # lost, counted only
    (["--audit-log-max-bytes", "0"], "error: --audit-log-max-bytes: must be a positive number of bytes, got 0"),
    (["--audit-seal"], "error: --audit-seal: seals the audit log, and there is none\n  fix: add --audit-log FILE"),
    (["--audit-log", "/proc/nope/a.jsonl", "--audit-key", "/proc/nope/k"],
     "error: --audit-key /proc/nope/k: cannot read the seal key"),
    (["--audit-log", "/proc/nope/a.jsonl", "--audit-key", "/dev/null"],
     "error: --audit-key /dev/null: the seal key is 0 bytes; at least 16 are needed"),
    (["--quota-ledger", "/tmp/q.db"], "error: --quota-ledger: is only used with --auth"),
])
def test_flags_refused_before_serving_say_the_flag_once_and_the_fix(capsys, monkeypatch, repo, args, says):
    # in-process: these are refused before a model loads or a port opens; a flag let through fails the test
    # here instead of serving forever
    import azulite.serve.server
    from tests.cli.inprocess import exit_code

    def served(*a, **k):
        raise AssertionError(f"served with {args}: the flag was not refused")

    monkeypatch.setattr(azulite.serve.server, "serve", served)
    assert exit_code("serve", repo, *args) == 2
    err = capsys.readouterr().err
    assert says in err, err
    from azulite.serve import log_settings

    assert log_settings.ENV not in os.environ  # a refused flag left the caller's logging as it was
    assert "fix:" in err and "Traceback" not in err


def test_help_documents_every_connection_limit():
    from azulite.serve.limits import FLAGS

    p = subprocess.run([AZULITE, "serve", "--help"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0
    missing = [flag for flag in FLAGS.values() if flag not in p.stdout]
    assert not missing, missing


@pytest.fixture(scope="module")
def broken_repo(tmp_path_factory):
    return add_broken_models(build_model_repository(tmp_path_factory.mktemp("cli_broken"), ("add_sub_onnx",)))


def test_not_ready_says_what_failed_and_what_serves_grpc_alone(broken_repo):
    s = Served(str(broken_repo), "--allow-http", "false", "--allow-metrics", "false")
    try:
        out = "".join(s.lines)
        assert ("azulite serve started but NOT ready: /v2/health/ready answers 400 while a start-up model is not "
                "loaded (serving: add_sub_onnx; failed to load: broken_config, broken_onnx)") in out, out
        assert set(s.ports) == {"GRPCInferenceService", "ready"}, out
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{s.ports['GRPCInferenceService']}")
        try:
            assert g.is_server_live() and not g.is_server_ready() and g.is_model_ready("add_sub_onnx")
        finally:
            g.close()
    finally:
        s.stop()


def test_strict_readiness_false_is_ready_while_a_model_failed_http_alone(broken_repo):
    s = Served(str(broken_repo), "--allow-grpc", "false", "--strict-readiness", "false")
    try:
        out = "".join(s.lines)
        assert "azulite serve ready (model control mode: none; serving: add_sub_onnx; failed to load: " in out, out
        assert set(s.ports) == {"HTTPService", "Metrics", "ready"}, out
        h = httpclient.InferenceServerClient(f"127.0.0.1:{s.ports['HTTPService']}")
        try:
            assert h.is_server_ready() and not h.is_model_ready("broken_onnx")
        finally:
            h.close()
    finally:
        s.stop()


def test_exit_on_error_exits_1_naming_the_models(broken_repo):
    p = subprocess.run([AZULITE, "serve", str(broken_repo), "--exit-on-error", "true", "--http-port", "0",
                        "--grpc-port", "0", "--metrics-port", "0", "--http-address", "127.0.0.1", "--grpc-address",
                        "127.0.0.1", "--metrics-address", "127.0.0.1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "error: --exit-on-error: model(s) failed to load: broken_config, broken_onnx" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "ready" not in p.stdout


def test_a_port_in_use_is_a_clear_error(repo):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        p = subprocess.run([AZULITE, "serve", str(repo), "--http-address", "127.0.0.1", "--http-port", str(port),
                            "--grpc-port", "0", "--metrics-port", "0", "--grpc-address", "127.0.0.1",
                            "--metrics-address", "127.0.0.1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"error: --http-port {port}: cannot listen" in p.stderr and "fix: choose free ports" in p.stderr
    assert "Traceback" not in p.stderr


def test_exit_timeout_expires_with_a_request_in_flight(tmp_path):
    """A request stuck in a model: SIGTERM drains for --exit-timeout-secs, then stops without its answer."""
    with Gate(tmp_path) as gate:
        s = Served(str(gate.repository), "--exit-timeout-secs", "1")
        outcome: list = []
        try:
            c = httpclient.InferenceServerClient(f"127.0.0.1:{s.ports['HTTPService']}", network_timeout=300)

            def call():
                i = httpclient.InferInput("INPUT0", [1], "FP32")
                i.set_data_from_numpy(np.ones(1, np.float32))
                try:
                    outcome.append(c.infer("gate_py", [i]))
                except Exception as exc:  # noqa: BLE001 - asserted below
                    outcome.append(exc)

            t = threading.Thread(target=call)
            t.start()
            assert gate.entered(1)
            s.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 120  # a safety net: the drain gives up after 1 s
            while time.monotonic() < deadline and not any("azulite serve stopped" in x for x in s.lines):
                time.sleep(0.05)
            assert any("azulite serve stopped" in x for x in s.lines), "".join(s.lines)
            t.join(120)
            assert len(outcome) == 1 and isinstance(outcome[0], Exception), outcome  # never answered
            assert s.proc.wait(120) == 0  # with the model still stuck: it did not wait for it
            assert "still executing after --exit-timeout-secs 1: exiting without their answers" in "".join(s.lines)
        finally:
            gate.open()
            s.stop()


def _start_up_lines(*args: str) -> str:
    """``azulite serve ARGS``'s own lines up to its ready line (or its exit); then it is stopped."""
    proc = subprocess.Popen([AZULITE, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "400"})
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "azulite serve ready" in line:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    return "".join(lines)


def test_open_model_control_warning_names_the_bound_port_not_0(repo):
    # 127.0.0.2 is loopback (nothing outside reaches it) but not an address the warning trusts
    out = _start_up_lines(str(repo), "--model-control-mode", "explicit", "--http-address", "127.0.0.2",
                          "--http-port", "0", "--allow-grpc", "false", "--allow-metrics", "false")
    port = int(re.search(r"Started HTTPService at 127\.0\.0\.2:(\d+)", out).group(1))
    assert port != 0 and f"model control is open on http 127.0.0.2:{port} with no guard" in out, out
    assert "127.0.0.2:0 " not in out, out  # was "open on http 127.0.0.2:0"


def test_a_rate_limit_for_a_model_the_repository_lacks_is_warned(repo):
    """A typo in --model-rate-limit limited nothing, silently."""
    out = _start_up_lines(str(repo), "--http-address", "127.0.0.1", "--http-port", "0", "--allow-grpc", "false",
                          "--allow-metrics", "false", "--model-rate-limit", "string_pyy=5",
                          "--model-rate-limit", "string_py=5")
    assert "azulite serve ready" in out, out
    assert "--model-rate-limit string_pyy=5: the repository has no model 'string_pyy'" in out, out
    assert "no model 'string_py'" not in out, out


def test_a_config_syntax_error_is_logged_once_with_its_fix(tmp_path):
    root = build_model_repository(tmp_path / "repo", ("add_sub_onnx", "add_sub_py", "add_sub_ensemble"))
    (root / "add_sub_onnx" / "config.pbtxt").write_text('name: "add_sub_onnx"\nplatform: onnxruntime_onnx"\n')
    p = subprocess.run([AZULITE, "serve", str(root), "--exit-on-error", "true", "--http-port", "0", "--grpc-port",
                        "0", "--metrics-port", "0", "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
                        "--metrics-address", "127.0.0.1"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "400"})
    assert p.returncode == 1, p.stdout + p.stderr
    # was logged twice (again when the ensemble loaded its step), with no fix line
    assert p.stderr.count("failed to parse the model configuration of 'add_sub_onnx': line 2 column 11: ") == 1, \
        p.stderr
    assert f"fix: correct line 2 of {root / 'add_sub_onnx' / 'config.pbtxt'}: config.pbtxt is protobuf text" \
        in p.stderr, p.stderr
    assert "ensemble 'add_sub_ensemble' depends on 'add_sub_onnx', which failed to load (see its own error)" \
        in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(("flags", "completes"), [
    ((), True),
    (("--disable-auto-complete-config",), False),
    (("--strict-model-config", "true"), False),  # tritonserver's older flag for the same
    (("--strict-model-config", "false"), True),
])
def test_disable_auto_complete_config_serves_configs_as_written(tmp_path, flags, completes):
    """A model with no config.pbtxt loads by auto-complete from its model file, unless it is disabled."""
    repo = build_model_repository(tmp_path / "repo", ("add_sub_onnx",))
    (repo / "bare_onnx" / "1").mkdir(parents=True)
    (repo / "bare_onnx" / "1" / "model.onnx").write_bytes((repo / "add_sub_onnx" / "1" / "model.onnx").read_bytes())
    s = Served(str(repo), *flags)
    try:
        text = "".join(s.lines)
        assert re.search(r"add_sub_onnx\s*│\s*1\s*│\s*READY", text), text
        if completes:
            assert re.search(r"bare_onnx\s*│\s*1\s*│\s*READY", text), text
        else:
            assert "no config.pbtxt, and auto-complete is disabled" in text, text
    finally:
        s.stop()
