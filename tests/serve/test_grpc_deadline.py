"""A gRPC client's deadline (``grpc-timeout``) on azulite's own HTTP/2 transport, through a real server
(one process, and ``--workers 2`` where the front-end tells the model host): when it passes before the
answer, the call ends DEADLINE_EXCEEDED, and a request still queued for its model never runs."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.serve.h2client import burst
from tests.serve.test_workers import Workers, call, wait_for, write_model

# every execute says it is inside, waits for the gate, then logs the X it ran
LOGGED_PY = '''
import json
import os
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.dir = json.loads(args["model_config"])["parameters"]["dir"]["string_value"]

    def execute(self, requests):
        open(os.path.join(self.dir, "inside"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(self.dir, "open")) and time.monotonic() < deadline:
            time.sleep(0.01)
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            with open(os.path.join(self.dir, "ran"), "a") as f:
                f.write(" ".join(str(float(v)) for v in x.ravel()) + "\\n")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2), pb_utils.Tensor("ROWS", np.ones_like(x, np.int64)),
                                                   pb_utils.Tensor("RID", np.ones_like(x, np.int64))]))
        return out
'''
CONFIG = '''
name: "logged_py"
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "ROWS" data_type: TYPE_INT64 dims: [ 1 ] },
         { name: "RID" data_type: TYPE_INT64 dims: [ 1 ] } ]
dynamic_batching { }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "dir" value: { string_value: "DIR" } }
'''


def failures(server: Workers) -> int:
    c = server.conn()
    try:
        return int(call(c, "GET", "/v2/models/logged_py/stats")[1]["model_stats"][0]["inference_stats"]["fail"]["count"])
    finally:
        c.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_passed_deadline_is_answered_and_its_queued_request_never_runs(tmp_path: Path, workers: int):
    state = tmp_path / "state"
    state.mkdir()
    repo = tmp_path / "repo"
    write_model(repo, "logged_py", CONFIG.replace("DIR", str(state)), LOGGED_PY)
    server = Workers(repo, workers=workers)
    try:
        port = server.ports["GRPCInferenceService"]
        held: dict = {}
        first = threading.Thread(target=lambda: held.update(burst(port, "logged_py", [(1, [1.0])])))
        first.start()
        wait_for(lambda: (state / "inside").exists(), "the first request to reach the model")
        # queued behind the held one: its 200 ms pass first, whatever the machine's speed
        late = burst(port, "logged_py", [(2, [2.0])], headers=(("grpc-timeout", "200m"),))
        assert late[2][0] == 4 and "Deadline" in late[2][1], late  # DEADLINE_EXCEEDED
        # the model host has heard (its statistics count the failure) before the model may go on
        wait_for(lambda: failures(server) == 1, "the cancelled request to be counted")
        (state / "open").touch()
        first.join(120)
        assert held[1][0] == 0 and held[1][2]["Y"].ravel().tolist() == [2.0]
        ok = burst(port, "logged_py", [(3, [3.0])], headers=(("grpc-timeout", "60S"),))  # far away: no change
        assert ok[3][0] == 0 and ok[3][2]["Y"].ravel().tolist() == [6.0]
        assert (state / "ran").read_text().split() == ["1.0", "3.0"]  # 2.0 never ran
        c = server.conn()
        stats = call(c, "GET", "/v2/models/logged_py/stats")[1]["model_stats"][0]["inference_stats"]
        c.close()
        assert int(stats["success"]["count"]) == 2 and int(stats["fail"]["count"]) == 1, stats
    finally:
        (state / "open").touch()
        server.stop()


def test_a_grpc_timeout_it_cannot_read_is_ignored(tmp_path: Path):
    """As gRPC's own servers do: the call runs as if it had none."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "open").touch()
    repo = tmp_path / "repo"
    write_model(repo, "logged_py", CONFIG.replace("DIR", str(state)), LOGGED_PY)
    server = Workers(repo, workers=1)
    try:
        port = server.ports["GRPCInferenceService"]
        for i, value in enumerate(("soon", "123456789S", "5x", "S", "-1S")):
            answer = burst(port, "logged_py", [(i, [1.0])], headers=(("grpc-timeout", value),))
            assert answer[i][0] == 0, (value, answer)
    finally:
        server.stop()
