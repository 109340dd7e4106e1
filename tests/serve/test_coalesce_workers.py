"""Coalescing (serve/coalesce.py) in a real ``azulite serve --workers 2``: gRPC calls that reach a
front-end in one read (one HTTP/2 connection, every call in one write) go to the model host as one
request, and each caller still gets exactly its own answer, id and error; the Python model still sees
each caller's request; statistics count callers. Bursts are sent until the host's counter shows that
requests did coalesce (the kernel decides how a write is read; the counter is the event waited on)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.serve.h2client import burst
from tests.serve.test_workers import Workers, call, write_model

# Y = 2X; ROWS: the rows of the request execute() got; RID: that request's id (ids are numbers here);
# a negative X is that request's own error
SEEN_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            if (x < 0).any():
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"negative input in {r.request_id()}")))
                continue
            n = len(x)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", x * 2),
                pb_utils.Tensor("ROWS", np.full((n, 1), n, np.int64)),
                pb_utils.Tensor("RID", np.full((n, 1), int(r.request_id()), np.int64))]))
        return out
'''
CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 16
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }}, {{ name: "ROWS" data_type: TYPE_INT64 dims: [ 1 ] }},
         {{ name: "RID" data_type: TYPE_INT64 dims: [ 1 ] }} ]
{batching}
'''
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("coalesce_repo")
    write_model(root, "seen_py", CONFIG.format(name="seen_py", batching="dynamic_batching { }"), SEEN_PY)
    # no dynamic batching: its requests are never run as one, whatever the front-end sent
    write_model(root, "plain_py", CONFIG.format(name="plain_py", batching=""), SEEN_PY)
    s = Workers(root)
    yield s
    s.stop()


def coalesced(served, model: str, ran: str) -> float:
    return served.metric("azulite_coalesced_requests_total", f'{{model="{model}",ran="{ran}"}}')


def until_coalesced(served, model: str, ran: str, make_calls, check) -> int:
    """Bursts (each checked) until the host's counter of requests that came coalesced grew (so at least
    one of these bursts did); returns the calls sent."""
    before = coalesced(served, model, ran)
    sent = 0
    for attempt in range(50):
        calls = make_calls(attempt)
        check(calls, burst(served.ports["GRPCInferenceService"], model, calls))
        sent += len(calls)
        if coalesced(served, model, ran) > before:
            return sent
    raise AssertionError(f"50 bursts and no request of {model} reached the model host coalesced ({ran})")


def expect_own_answers(calls, answers):
    for rid, xs in calls:
        status, message, outputs = answers[rid]
        if min(xs) < 0:
            assert status != 0 and f"negative input in {rid}" in message, (rid, status, message)
            continue
        assert status == 0, (rid, message)
        n = len(xs)
        np.testing.assert_array_equal(outputs["Y"], np.array(xs, np.float32).reshape(n, 1) * 2)
        # the model got this caller's request alone: its rows, its id
        assert outputs["ROWS"].ravel().tolist() == [n] * n and outputs["RID"].ravel().tolist() == [rid] * n


def test_calls_read_together_run_as_one_and_each_caller_gets_its_own_answer(served):
    sent = until_coalesced(served, "seen_py", "together",
                           lambda k: [(1000 * k + i, [float(1000 * k + i)] * (1 + i % 3)) for i in range(8)],
                           expect_own_answers)
    c = served.conn()
    stats = call(c, "GET", "/v2/models/seen_py/stats")[1]["model_stats"][0]
    c.close()
    # statistics count callers and their rows, not what crossed to the host
    assert int(stats["inference_stats"]["success"]["count"]) == sent
    assert int(stats["inference_stats"]["queue"]["count"]) == sent
    assert int(stats["inference_count"]) == sent // 8 * (1 + 2 + 3 + 1 + 2 + 3 + 1 + 2)
    assert served.metric("azulite_coalesced_total", '{model="seen_py"}') >= 1


def test_one_callers_error_is_its_own(served):
    def calls(k):  # every third caller sends a negative X: its own error, the others their answers
        return [(5000 + 100 * k + i, [-1.0 if i % 3 == 0 else float(i)]) for i in range(9)]

    # a burst with errors among its calls reached the host coalesced (the counter grew during these)
    until_coalesced(served, "seen_py", "together", calls, expect_own_answers)
    for k in range(3):
        answers = burst(served.ports["GRPCInferenceService"], "seen_py", calls(50 + k))
        expect_own_answers(calls(50 + k), answers)
        assert sum(1 for status, _, _ in answers.values() if status != 0) == 3


def test_a_model_that_cannot_take_them_as_one_runs_them_one_by_one(served):
    until_coalesced(served, "plain_py", "one_by_one",
                    lambda k: [(9000 + 10 * k + i, [float(i + 1)] * (1 + i % 2)) for i in range(6)],
                    expect_own_answers)
    assert coalesced(served, "plain_py", "together") == -1.0  # never counted: no sample
