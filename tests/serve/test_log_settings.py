"""Triton's logging extension (serve/log_settings.py) through ``azulite serve``: tritonclient reads and
changes the settings over HTTP and gRPC, and the change decides which of a Python model's
``pb_utils.Logger`` lines reach the server's log, for an instance in the server's process and one in its
own process alike; a bad setting is the client's 400 / INVALID_ARGUMENT naming it and changes nothing."""

from __future__ import annotations

import http.client
import json
import os
import logging
import re
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as spb
from tritonclient.grpc import service_pb2_grpc as sgrpc

from azulite.errors import InvalidArgument, Unsupported
from azulite.serve import log_settings
from tests.cli.test_serve import Served

TALK = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]

    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            n = int(x.reshape(-1)[0])
            pb_utils.Logger.log_verbose(f"verbose {self.name} {n}")
            pb_utils.Logger.log_info(f"info {self.name} {n}")
            pb_utils.Logger.log_warn(f"warn {self.name} {n}")
            pb_utils.Logger.log_error(f"error {self.name} {n}")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return out
"""
CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }} ]
parameters {{ key: "azulite_instance_process" value: {{ string_value: "{processes}" }} }}
"""
MODELS = {"talk_threads": "false", "talk_procs": "true"}
DEFAULTS = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0,
            "log_format": "default"}


@pytest.fixture()
def repo(tmp_path):
    for name, processes in MODELS.items():
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(CONFIG.format(name=name, processes=processes))
        (tmp_path / name / "1" / "model.py").write_text(TALK)
    return tmp_path


def said(served: Served, n: int) -> dict[str, list[str]]:
    """Call both models with ``n``; once each model's error line for ``n`` is in the log (the last it writes,
    so the lines before it are there too if they were written), the lines for ``n`` by model."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{served.ports['HTTPService']}")
    for name in MODELS:
        x = httpclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([n], np.int32))
        client.infer(name, [x])
    client.close()
    deadline = time.monotonic() + 60  # a safety net; the condition is what is waited on
    while not all(any(f"error {name} {n}" in line for line in served.lines) for name in MODELS):
        assert time.monotonic() < deadline, "".join(served.lines[-40:])
        time.sleep(0.02)
    return {name: [line for line in served.lines if line.rstrip().endswith(f"{name} {n}")] for name in MODELS}


def kinds(lines: list[str]) -> set[str]:
    return {line.rstrip().rsplit(" ", 3)[-3] for line in lines}


def post(served: Served, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", served.ports["HTTPService"], timeout=60)
    conn.request("POST", "/v2/logging", body=body)
    response = conn.getresponse()
    answer = json.loads(response.read())
    conn.close()
    return response.status, answer


@pytest.mark.parametrize("workers", ["1", "2"])
def test_log_settings_choose_a_models_lines_in_every_process(repo, workers):
    """With ``--workers 2`` the settings are changed through a front-end and obeyed by the model host (the
    thread instance) and its instance process."""
    served = Served(str(repo), "--workers", workers)
    try:
        http_client = httpclient.InferenceServerClient(f"127.0.0.1:{served.ports['HTTPService']}")
        grpc_url = f"127.0.0.1:{served.ports['GRPCInferenceService']}"
        grpc_client = grpcclient.InferenceServerClient(grpc_url)
        assert http_client.get_log_settings() == DEFAULTS  # Triton's defaults (test_metadata_triton.py)
        got = grpc_client.get_log_settings(as_json=True)["settings"]
        assert {k: next(iter(v.values())) for k, v in got.items()} == {**DEFAULTS, "log_verbose_level": 0}
        assert "logging" in http_client.get_server_metadata()["extensions"]
        for name, lines in said(served, 1).items():
            assert kinds(lines) == {"info", "warn", "error"}, (name, lines)  # no verbose line at level 0

        changed = http_client.update_log_settings({"log_verbose_level": 1, "log_info": False})
        assert changed == {**DEFAULTS, "log_verbose_level": 1, "log_info": False}
        for name, lines in said(served, 2).items():
            assert kinds(lines) == {"verbose", "warn", "error"}, (name, lines)

        answer = grpc_client.update_log_settings({"log_format": "ISO8601", "log_info": True}, as_json=True)
        assert answer["settings"]["log_format"] == {"string_param": "ISO8601"}
        for name, lines in said(served, 3).items():
            assert kinds(lines) == {"verbose", "info", "warn", "error"}, (name, lines)
            assert all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ", line) for line in lines), lines

        settings = http_client.get_log_settings()
        for body, status, words in (
            (b'{"log_verbose_level": -1}', 400, "'log_verbose_level' must be an integer >= 0"),
            (b'{"log_verbose_level": true}', 400, "'log_verbose_level' must be an integer >= 0"),
            (b'{"log_info": "yes"}', 400, "'log_info' must be a boolean"),
            (b'{"log_format": "bad", "log_info": false}', 400, "'log_format' must be one of default, ISO8601"),
            (b'{"log_file": "/tmp/elsewhere.log"}', 501, "log file location can not be updated"),
            (b"[1]", 400, "must be a JSON object"),
            (b"{nope", 400, "malformed JSON body"),
        ):
            got_status, answer = post(served, body)
            assert got_status == status and words in answer["error"], (body, got_status, answer)
        assert http_client.get_log_settings() == settings  # a refused update changed nothing
        stub = sgrpc.GRPCInferenceServiceStub(channel := grpc.insecure_channel(grpc_url))
        wrong = spb.LogSettingsRequest.SettingValue(string_param="yes")
        with pytest.raises(grpc.RpcError) as info:
            stub.LogSettings(spb.LogSettingsRequest(settings={"log_info": wrong}), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'log_info'" in info.value.details()
        channel.close()
        http_client.close()
        grpc_client.close()
    finally:
        served.stop()


def test_which_lines_each_setting_shows():
    quiet = log_settings.LogSettings(log_info=False, log_warning=False, log_error=True, log_verbose_level=0)
    assert [quiet.shows(level, "azulite.x") for level in (10, 20, 30, 40, 50)] == [False, False, False, True, True]
    loud = log_settings.LogSettings(log_verbose_level=2)
    assert loud.shows(logging.DEBUG, "azulite.serve.python_model") and not loud.shows(logging.DEBUG, "urllib3")
    default = log_settings.LogSettings()
    # a library's info line (an Azure SDK logs every HTTP call) is verbose; its warnings are not
    assert not default.shows(logging.INFO, "azure.core") and loud.shows(logging.INFO, "azure.core")
    assert default.shows(logging.WARNING, "azure.core") and default.shows(logging.INFO, "azulite")
    assert not default.shows(logging.INFO, "azulitex")
    with pytest.raises(InvalidArgument, match="'log_warning' must be a boolean"):
        log_settings.checked_update({"log_warning": 1})
    for value in ("x.log", ""):  # any value, the current one too: Triton 2.51 answers 501 to both
        with pytest.raises(Unsupported):
            log_settings.checked_update({"log_file": value})
    assert log_settings.checked_update({"unknown": 1, "log_verbose_level": 3}) == {"log_verbose_level": 3}


def test_back_to_back_updates_are_each_seen(tmp_path, monkeypatch):
    """A hundred updates in a row each read back: the cached settings notice every replacement of the file
    (its inode and time; where a coarse clock gives two files one time, _write moves it on)."""
    path = tmp_path / "log.json"
    monkeypatch.setenv(log_settings.ENV, str(path))
    log_settings._write(str(path), log_settings.LogSettings())
    for i in range(100):
        assert log_settings.update({"log_verbose_level": i % 3, "log_info": i % 2 == 0}) == log_settings.LogSettings(
            log_verbose_level=i % 3, log_info=i % 2 == 0)
        assert log_settings.current().log_verbose_level == i % 3


def test_a_killed_servers_settings_file_is_removed_by_the_next(tmp_path, monkeypatch):
    import subprocess
    import sys
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"azulite-log-{int(dead.stdout)}-abc.json"  # its process has ended, its file stayed
    stale.write_text("{}")
    foreign = tmp_path / "azulite-log-notapid-x.json"
    foreign.write_text("{}")
    monkeypatch.setenv(log_settings.ENV, "")  # restored (unset) after the test: _create sets it
    monkeypatch.delenv(log_settings.ENV)
    path = log_settings._create(log_settings.LogSettings())
    assert not stale.exists() and foreign.exists() and path.startswith(str(tmp_path / f"azulite-log-{os.getpid()}-"))


def test_a_server_started_inside_another_servers_process_tree_has_its_own_settings(repo, tmp_path, monkeypatch):
    """``AZULITE_LOG_SETTINGS`` inherited from another server (a test runner, a supervisor started by one)
    is that server's: ``azulite serve`` makes its own file, so neither changes the other's logging."""
    theirs = tmp_path / "theirs.json"
    theirs.write_text(json.dumps({**DEFAULTS, "log_verbose_level": 3, "log_format": "ISO8601"}))
    monkeypatch.setenv(log_settings.ENV, str(theirs))
    served = Served(str(repo))
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{served.ports['HTTPService']}")
        assert client.get_log_settings() == DEFAULTS
        client.update_log_settings({"log_verbose_level": 1})
        client.close()
    finally:
        served.stop()
    assert json.loads(theirs.read_text())["log_verbose_level"] == 3  # untouched
