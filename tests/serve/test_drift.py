"""Output monitoring: PSI and KS against known distributions, the rolling window, and a real server
whose model opts in exporting the figures that move when its outputs shift."""

from __future__ import annotations

import http.client
import shutil

import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from azulite.errors import ModelLoadError
from azulite.serve.drift import OutputMonitor, ks, psi, window_of
from azulite.serve.proto import model_config_pb2 as mc

from .conftest import MODELS_DIR
from .frontends import running_server


def test_psi_and_ks_on_known_distributions():
    rng = np.random.default_rng(0)
    ref = rng.normal(0, 1, 5000)
    same = rng.normal(0, 1, 5000)
    shifted = rng.normal(1, 1, 5000)
    assert psi(ref, same) < 0.02 and ks(ref, same) < 0.05
    assert psi(ref, shifted) > 0.25 and ks(ref, shifted) > 0.3
    # KS of disjoint samples is 1; of a sample with itself 0
    assert ks(np.zeros(10), np.ones(10)) == 1.0 and ks(ref, ref) == 0.0


def test_monitor_windows():
    m = OutputMonitor(100, per_request=4)
    for _ in range(25):  # 25 requests x 4 sampled values: the reference fills exactly
        m.observe([("y", np.zeros(64, dtype=np.float32)), ("label", np.array([b"x"], dtype=object))])
    assert m.figures() == []  # a reference but no current window yet
    for _ in range(10):
        m.observe([("y", np.ones(8, dtype=np.float32))])
    [f] = m.figures()
    assert (f.output, f.reference, f.current, f.ks) == ("y", 100, 40, 1.0)
    for _ in range(100):  # the current window rolls: only the last 100 values count
        m.observe([("y", np.zeros(4, dtype=np.float32))])
    [f] = m.figures()
    assert f.current == 100 and f.ks == 0.0 and f.psi < 1e-9


def test_window_parameter_is_validated():
    config = mc.ModelConfig(name="m")
    assert window_of(config) == 0
    config.parameters["azulite_drift_window"].string_value = "500"
    assert window_of(config) == 500
    config.parameters["azulite_drift_window"].string_value = "5"
    with pytest.raises(ModelLoadError, match="azulite_drift_window"):
        window_of(config)


def _metrics(server) -> dict:
    host, port = server.metrics_url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("azulite_output_psi", "azulite_output_ks"):
                out[(sample.name, sample.labels["output"])] = sample.value
    return out


def test_server_exports_drift_of_a_model_that_opts_in(tmp_path):
    repo = tmp_path / "repo"
    (repo / "echo" / "1").mkdir(parents=True)
    config = (MODELS_DIR / "slow_py" / "config.pbtxt").read_text().replace('"slow_py"', '"echo"').replace(
        '"0.2"', '"0"')
    (repo / "echo" / "config.pbtxt").write_text(
        config + 'parameters { key: "azulite_drift_window" value: { string_value: "200" } }\n')
    shutil.copy(MODELS_DIR / "slow_py" / "model.py", repo / "echo" / "1" / "model.py")
    rng = np.random.default_rng(1)
    with running_server(repo) as s:
        client = httpclient.InferenceServerClient(s.http_url)

        def send(values):
            for v in values:
                i = httpclient.InferInput("INPUT0", [1, 1], "FP32")
                i.set_data_from_numpy(np.array([[v]], dtype=np.float32))
                client.infer("echo", [i])

        send(rng.normal(0, 1, 200))  # the reference
        assert _metrics(s) == {}
        send(rng.normal(0, 1, 200))
        calm = _metrics(s)
        assert calm[("azulite_output_psi", "OUTPUT0")] < 0.2 and calm[("azulite_output_ks", "OUTPUT0")] < 0.2
        send(rng.normal(2, 1, 200))  # the outputs shift
        drifted = _metrics(s)
        assert drifted[("azulite_output_psi", "OUTPUT0")] > 1.0 and drifted[("azulite_output_ks", "OUTPUT0")] > 0.5
        client.close()
