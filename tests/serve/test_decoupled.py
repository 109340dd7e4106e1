"""Decoupled models (serve/decoupled.py) through tritonclient's gRPC streaming client against a real
azulite server, and the same conversation with real Triton (Python backend): equal responses."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import build_model_repository
from .frontends import running_server

REQUESTS = {"a": [1, 2, 3], "b": [], "c": [4, -1, 5]}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return build_model_repository(tmp_path_factory.mktemp("decoupled"), ("repeat_py", "add_sub_py"))


def conversation(grpc_url: str, empty_final: bool) -> list:
    """Three requests on one stream; stop_stream returns once the server closed it (every response sent).
    -> what the callback saw: per response (request id, OUT, IDX, final flag) or ("error", text)."""
    seen: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: seen.put((result, error)))
    try:
        for rid, values in REQUESTS.items():
            inp = grpcclient.InferInput("IN", [len(values)], "INT32")
            inp.set_data_from_numpy(np.array(values, dtype=np.int32))
            client.async_stream_infer("repeat_py", [inp], request_id=rid, enable_empty_final_response=empty_final)
    finally:
        client.stop_stream()
    out = []
    while not seen.empty():
        result, error = seen.get_nowait()
        if error is not None:
            out.append(("error", error.message()))
            continue
        response = result.get_response()
        # Triton marks every streamed response, asked for the empty final one or not
        final = response.parameters["triton_final_response"].bool_param if "triton_final_response" in \
            response.parameters else None
        values = result.as_numpy("OUT")
        out.append((response.id, None if values is None or values.size == 0 else int(values[0]),
                    None if values is None or values.size == 0 else int(result.as_numpy("IDX")[0]), final))
    client.close()
    return out


def per_request(seen: list) -> dict:
    """Responses of concurrent requests interleave; each request's own keep their order."""
    grouped: dict = {}
    for entry in seen:
        grouped.setdefault(entry[0], []).append(entry)
    return grouped


def check(seen: list, empty_final: bool) -> None:
    grouped = per_request(seen)
    if empty_final:
        assert grouped["a"] == [("a", 1, 0, False), ("a", 2, 1, False), ("a", 3, 2, False), ("a", None, None, True)]
        assert grouped["b"] == [("b", None, None, True)]
        assert grouped["c"] == [("c", 4, 0, False)]
    else:
        assert grouped["a"] == [("a", 1, 0, False), ("a", 2, 1, False), ("a", 3, 2, False)]
        assert "b" not in grouped  # zero responses
        assert grouped["c"] == [("c", 4, 0, False)]
    assert len(grouped["error"]) == 1 and "element 1 is negative: -1" in grouped["error"][0][1]


def unary_errors(http_url: str, grpc_url: str) -> tuple[str, str]:
    """Unary infer of a decoupled model: refused over both protocols."""
    statuses = []
    for lib, url in ((httpclient, http_url), (grpcclient, grpc_url)):
        inp = lib.InferInput("IN", [2], "INT32")
        inp.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
        client = lib.InferenceServerClient(url)
        with pytest.raises(InferenceServerException) as info:
            client.infer("repeat_py", [inp])
        client.close()
        statuses.append(info.value)
    return statuses[0], statuses[1]


@pytest.mark.parametrize("grpc_impl", ["h2", "grpcio"])
def test_decoupled_model_streams_0_to_n_responses(repo, grpc_impl):
    with running_server(repo, grpc_impl=grpc_impl) as s:
        for empty_final in (True, False):
            check(conversation(s.grpc_url, empty_final), empty_final)
        http_err, grpc_err = unary_errors(s.http_url, s.grpc_url)
        # Triton's answer (501 / UNIMPLEMENTED, compared below), naming the model and what to do
        assert http_err.status() == "501" and "repeat_py" in http_err.message() and "decoupled" in http_err.message()
        assert grpc_err.status() == "StatusCode.UNIMPLEMENTED" and "ModelStreamInfer" in grpc_err.message()
        # a model answering once per request streams one response, as before
        client = grpcclient.InferenceServerClient(s.grpc_url)
        seen: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: seen.put((result, error)))
        x = np.ones((1, 16), np.float32)
        inputs = [grpcclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
        for i in inputs:
            i.set_data_from_numpy(x)
        client.async_stream_infer("add_sub_py", inputs, request_id="one")
        client.stop_stream()
        result, error = seen.get_nowait()
        assert error is None and seen.empty() and result.as_numpy("OUTPUT0").tolist() == (2 * x).tolist()
        assert result.get_response().parameters["triton_final_response"].bool_param is True
        client.close()
        stats = httpclient.InferenceServerClient(s.http_url).get_inference_statistics("repeat_py")
        inference = stats["model_stats"][0]["inference_stats"]
        assert inference["success"]["count"] == 4 and inference["fail"]["count"] == 2  # "c" twice; unary: refused


def test_same_responses_as_real_triton(repo, tmp_path):
    from .anchor import running_triton

    with running_triton(repo, tmp_path / "triton.log") as triton:
        theirs = {flag: per_request(conversation(triton.grpc_url, flag)) for flag in (True, False)}
        their_http, their_grpc = unary_errors(triton.http_url, triton.grpc_url)
    with running_server(repo) as s:
        ours = {flag: per_request(conversation(s.grpc_url, flag)) for flag in (True, False)}
        our_http, our_grpc = unary_errors(s.http_url, s.grpc_url)
    for flag in (True, False):
        assert {k: v for k, v in ours[flag].items() if k != "error"} == \
            {k: v for k, v in theirs[flag].items() if k != "error"}, flag
        assert len(ours[flag]["error"]) == len(theirs[flag]["error"]) == 1
        assert "element 1 is negative: -1" in theirs[flag]["error"][0][1]
    assert (our_http.status(), our_grpc.status()) == (their_http.status(), their_grpc.status())


GUARDED_PARAMS = """
parameters { key: "azulite_drift_window" value: { string_value: "10" } }
parameters { key: "azulite_fallback_model" value: { string_value: "repeat_light" } }
"""


def _stream(grpc_url: str, model: str, values: list[int]) -> list:
    """One request on a stream -> per response (OUT, the response's fallback parameters)."""
    seen: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: seen.put((result, error)))
    inp = grpcclient.InferInput("IN", [len(values)], "INT32")
    inp.set_data_from_numpy(np.array(values, dtype=np.int32))
    try:
        client.async_stream_infer(model, [inp], request_id="r")
    finally:
        client.stop_stream()  # returns once the server closed the stream: every response is in
    out = []
    while not seen.empty():
        result, error = seen.get_nowait()
        if error is not None:
            out.append(("error", error.message(), None))
            continue
        params = result.get_response().parameters
        out.append((int(result.as_numpy("OUT")[0]), params["fallback_from"].string_param if "fallback_from" in params
                    else None, params["fallback_reason"].string_param if "fallback_reason" in params else None))
    client.close()
    return out


@pytest.mark.parametrize("grpc_impl", ["h2", "grpcio"])
def test_streamed_responses_feed_drift_and_fall_back(tmp_path, grpc_impl):
    """A decoupled model's fallback and drift window work over ModelStreamInfer as for unary requests:
    each streamed response goes into the window; unloaded, the fallback streams, marked and counted."""
    root = build_model_repository(tmp_path / "repo", ("repeat_py",))
    config = (root / "repeat_py" / "config.pbtxt").read_text()
    for name, extra in (("repeat_guarded", GUARDED_PARAMS), ("repeat_light", "")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config.replace('"repeat_py"', f'"{name}"') + extra)
        (root / name / "1" / "model.py").write_bytes((root / "repeat_py" / "1" / "model.py").read_bytes())
    with running_server(root, grpc_impl=grpc_impl, model_control_mode="explicit",
                        load_models=("repeat_guarded", "repeat_light")) as s:
        assert _stream(s.grpc_url, "repeat_guarded", list(range(10))) == [(i, None, None) for i in range(10)]
        assert _stream(s.grpc_url, "repeat_guarded", [100, 101, 102]) == [(v, None, None) for v in (100, 101, 102)]
        monitor = s.server.dataplane._policies["repeat_guarded"][2]
        figures = {f.output: f for f in monitor.figures()}
        # the first 10 streamed values are the reference, the next 3 the current window: a full shift
        assert (figures["OUT"].reference, figures["OUT"].current) == (10, 3) and figures["OUT"].ks == 1.0
        assert (figures["IDX"].reference, figures["IDX"].current) == (10, 3)
        httpclient.InferenceServerClient(s.http_url).unload_model("repeat_guarded")
        assert _stream(s.grpc_url, "repeat_guarded", [7, 8]) == [(7, "repeat_guarded", "unavailable"),
                                                                (8, "repeat_guarded", "unavailable")]
        assert s.server.dataplane.fallbacks == {("repeat_guarded", "repeat_light", "unavailable"): 1}
        # a model with no fallback still refuses when unloaded
        httpclient.InferenceServerClient(s.http_url).unload_model("repeat_light")
        [(kind, message, _)] = _stream(s.grpc_url, "repeat_light", [1])
        assert kind == "error" and "repeat_light" in message
        # the model and its fallback both unloaded: the model's own answer (its 'unloaded', as unary infer
        # gives it), not the fallback's, and not counted as a fallback
        [(kind, message, _)] = _stream(s.grpc_url, "repeat_guarded", [1])
        assert kind == "error" and "'repeat_guarded' has no available versions" in message, message
        assert "repeat_light" not in message
        assert s.server.dataplane.fallbacks == {("repeat_guarded", "repeat_light", "unavailable"): 1}
