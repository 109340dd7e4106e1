"""Triton's trace extension (serve/trace.py): the settings over HTTP and gRPC as tritonclient sets them,
global and per model; the traces a sampled request leaves in the trace file, in Triton's JSON, their
timestamps in order; each bad setting the client's 400 (501 where Triton has the feature and azulite
not) naming it. Real Triton's own answers to the same settings: tests/serve/test_metadata_triton.py."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as spb
from tritonclient.grpc import service_pb2_grpc as sgrpc
from tritonclient.utils import InferenceServerException

from azulite.errors import SpecError
from azulite.serve.trace import TraceSettings, parse_trace_config

from .conftest import build_model_repository
from .frontends import running_server

ORDER = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
         "COMPUTE_END", "REQUEST_END"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return build_model_repository(tmp_path_factory.mktemp("trace"), ("add_sub_py", "string_py"))


def add_sub(client, lib, request_id: str) -> None:
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    inputs = [lib.InferInput(name, [1, 16], "FP32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(x)
    client.infer("add_sub_py", inputs, request_id=request_id)


def traces(path) -> list[dict]:
    """A trace file's traces: each header with its timestamps, in the order written."""
    by_id: dict[int, dict] = {}
    for obj in json.loads(path.read_text()):
        trace = by_id.setdefault(obj["id"], {"stamps": []})
        if "model_name" in obj:
            trace.update(obj)
        else:
            trace["stamps"] += obj["timestamps"]
    return list(by_id.values())


def test_sampled_requests_leave_tritons_trace_json(repo, tmp_path):
    trace_file = tmp_path / "trace.json"
    settings = parse_trace_config([f"triton,file={trace_file}", "triton,log-frequency=2"])
    with running_server(repo, trace=settings) as server:
        http = httpclient.InferenceServerClient(server.http_url)
        grpc_client = grpcclient.InferenceServerClient(server.grpc_url)
        assert http.get_trace_settings() == {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
                                             "log_frequency": "2", "trace_file": str(trace_file), "trace_mode": "triton"}
        assert "trace" in http.get_server_metadata()["extensions"]
        add_sub(http, httpclient, "before")  # tracing is off: nothing sampled
        on = http.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "3"})
        assert on["trace_level"] == ["TIMESTAMPS"] and on["trace_count"] == "3"
        for i in range(2):
            add_sub(http, httpclient, f"h{i}")
        for i in range(2):
            add_sub(grpc_client, grpcclient, f"g{i}")  # the third is traced, the fourth is past trace_count
        assert http.get_trace_settings()["trace_count"] == "0"  # counted down, as Triton's
        first = traces(tmp_path / "trace.json.0")  # written once log_frequency (2) traces were collected
        assert [t["request_id"] for t in first] == ["h0", "h1"]
        # a model's own settings: every second request of string_py, for two traces
        own = grpc_client.update_trace_settings(model_name="string_py", settings={
            "trace_count": "2", "trace_rate": "2"}, as_json=True)["settings"]
        assert own["trace_rate"]["value"] == ["2"] and own["trace_level"]["value"] == ["TIMESTAMPS"]
        for i in range(4):
            text = httpclient.InferInput("TEXT", [1, 1], "BYTES")
            text.set_data_from_numpy(np.array([[b"ab"]], dtype=object))
            http.infer("string_py", [text], request_id=f"s{i}")
        assert http.get_trace_settings("string_py")["trace_count"] == "0"
        # clearing the model's fields brings the global ones back
        cleared = http.update_trace_settings("string_py", settings={"trace_count": None, "trace_rate": None})
        assert cleared["trace_count"] == "0" and cleared["trace_rate"] == "1"  # the global ones
    second = traces(tmp_path / "trace.json.1")  # the next two
    assert [(t["model_name"], t["request_id"]) for t in second] == [("add_sub_py", "g0"), ("string_py", "s0")]
    last = traces(tmp_path / "trace.json.2")  # the one left, written at shutdown
    assert [(t["model_name"], t["request_id"]) for t in last] == [("string_py", "s2")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json.0", "trace.json.1", "trace.json.2"]
    rest = second + last
    for trace in first + rest:
        assert trace["model_version"] == 1 and set(trace) == {"id", "model_name", "model_version", "request_id", "stamps"}
        names = [s["name"] for s in trace["stamps"]]
        assert names == ORDER, names
        times = [s["ns"] for s in trace["stamps"]]
        assert times == sorted(times) and times[0] > 0, times
    assert len({t["id"] for t in first + rest}) == 5


def test_bad_trace_settings_name_what_is_wrong(repo, tmp_path):
    with running_server(repo) as server:  # no trace file given at start
        http = httpclient.InferenceServerClient(server.http_url)
        before = http.get_trace_settings()
        for settings, status, words in (
            ({"trace_level": ["TIMESTAMPS"]}, "400", "trace file name is not given"),
            ({"trace_rate": "0"}, "400", "Expecting value >= 1"),
            ({"trace_count": "x"}, "400", "Unable to parse 'trace_count', got: x"),
            ({"trace_count": "-2"}, "400", "Expecting value >= -1"),
            ({"log_frequency": "-1"}, "400", "Expecting value >= 0"),
            ({"trace_level": ["LOUD"]}, "400", "unknown level(s) ['LOUD']"),
            ({"trace_level": ["TENSORS"]}, "501", "TENSORS is not supported"),
            ({"trace_mode": "opentelemetry"}, "501", "not supported by azulite"),
            ({"trace_file": "/tmp/elsewhere.json"}, "501", "can not be updated through network protocol"),
            ({"trace_rate": None}, "400", "a global setting cannot be cleared"),
            ({"sample": "1"}, "400", "unknown trace setting 'sample'"),
        ):
            with pytest.raises(InferenceServerException) as info:
                http.update_trace_settings(settings=settings)
            assert info.value.status() == status and words in info.value.message(), (settings, info.value)
        with pytest.raises(InferenceServerException) as info:
            http.update_trace_settings("nope", settings={"trace_rate": "2"})
        assert info.value.status() == "404" and "nope" in info.value.message()
        assert http.get_trace_settings() == before  # nothing changed
        stub = sgrpc.GRPCInferenceServiceStub(channel := grpc.insecure_channel(server.grpc_url))
        with pytest.raises(grpc.RpcError) as err:
            stub.TraceSetting(spb.TraceSettingRequest(settings={
                "trace_rate": spb.TraceSettingRequest.SettingValue(value=["often"])}), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "trace_rate" in err.value.details()
        channel.close()


def test_trace_config_flags():
    assert parse_trace_config(["triton,file=/t.json", "rate=10", "level=TIMESTAMPS", "count=5"]) == TraceSettings(
        level=("TIMESTAMPS",), rate=10, count=5, file="/t.json")
    for flags, words in ((["level=TIMESTAMPS"], "needs a trace file"), (["rate"], "is not [MODE,]SETTING=VALUE"),
                         (["opentelemetry,url=x"], "opentelemetry"), (["speed=3"], "unknown setting 'speed'"),
                         (["rate=0"], "Expecting value >= 1")):
        with pytest.raises(SpecError, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
            parse_trace_config(flags)


def test_workers_share_one_tracer_and_shutdown_writes_the_rest(tmp_path):
    """``azulite serve --workers 2`` started tracing (``--trace-config``): requests through either front-end
    are traced by the model host, a change through a front-end is what every front-end answers, and a
    SIGTERM writes the traces still held to ``trace_file`` (log_frequency 0)."""
    import signal

    from tests.cli.test_serve import Served

    repo = build_model_repository(tmp_path / "repo", ("add_sub_py",))
    trace_file = tmp_path / "trace.json"
    served = Served(str(repo), "--workers", "2", "--trace-config", f"triton,file={trace_file}",
                    "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1")
    try:
        url = f"127.0.0.1:{served.ports['HTTPService']}"
        for i in range(3):
            http = httpclient.InferenceServerClient(url)  # a new connection each: either front-end
            add_sub(http, httpclient, f"w{i}")
            http.close()
        http = httpclient.InferenceServerClient(url)
        assert http.update_trace_settings(settings={"trace_rate": "7"})["trace_rate"] == "7"
        for _ in range(4):
            again = grpcclient.InferenceServerClient(f"127.0.0.1:{served.ports['GRPCInferenceService']}")
            assert again.get_trace_settings(as_json=True)["settings"]["trace_rate"]["value"] == ["7"]
            again.close()
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(120) == 0
    finally:
        served.stop()
    written = traces(trace_file)
    assert [t["request_id"] for t in written] == ["w0", "w1", "w2"]
    assert all([s["name"] for s in t["stamps"]] == ORDER for t in written)


def test_a_trace_reads_as_real_tritons(repo, tmp_path):
    """The same requests traced by real Triton 2.51 and by azulite: the same header fields, and azulite's
    timestamps are Triton's data-plane ones, in the same order (Triton adds its front-end's receive and
    send times and INFER_RESPONSE_COMPLETE, which azulite does not take)."""
    from .anchor import running_triton

    written = {}
    for side in ("triton", "azulite"):
        trace_file = tmp_path / side / "trace.json"
        trace_file.parent.mkdir()
        flags = [f"triton,file={trace_file}", "triton,log-frequency=1", "level=TIMESTAMPS", "rate=1"]
        if side == "triton":
            with running_triton(repo, tmp_path / "triton.log", args=tuple(f"--trace-config={f}" for f in flags)) as t:
                http = httpclient.InferenceServerClient(t.http_url)
                add_sub(http, httpclient, "t0")
                add_sub(grpcclient.InferenceServerClient(t.grpc_url), grpcclient, "t1")
        else:
            with running_server(repo, trace=parse_trace_config(flags)) as server:
                add_sub(httpclient.InferenceServerClient(server.http_url), httpclient, "t0")
                add_sub(grpcclient.InferenceServerClient(server.grpc_url), grpcclient, "t1")
        written[side] = traces(trace_file.with_name("trace.json.0")) + traces(trace_file.with_name("trace.json.1"))
    theirs, ours = written["triton"], written["azulite"]
    assert [(t["model_name"], t["model_version"], t["request_id"]) for t in theirs] == \
        [(t["model_name"], t["model_version"], t["request_id"]) for t in ours] == [("add_sub_py", 1, "t0"), ("add_sub_py", 1, "t1")]
    for mine, real in zip(ours, theirs):
        assert set(mine) == set(real)
        real_names = [s["name"] for s in sorted(real["stamps"], key=lambda s: s["ns"])]
        data_plane = [n for n in real_names if not n.startswith(("HTTP_", "GRPC_")) and n != "INFER_RESPONSE_COMPLETE"]
        assert [s["name"] for s in mine["stamps"]] == data_plane == ORDER, real_names


def test_a_decoupled_models_stream_is_traced_to_its_final_response(tmp_path):
    import queue

    repo = build_model_repository(tmp_path / "repo", ("repeat_py",))
    trace_file = tmp_path / "trace.json"
    flags = [f"triton,file={trace_file}", "level=TIMESTAMPS", "rate=1"]
    with running_server(repo, trace=parse_trace_config(flags)) as server:
        answers: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        values = grpcclient.InferInput("IN", [3], "INT32")
        values.set_data_from_numpy(np.array([4, 5, 6], np.int32))
        client.async_stream_infer("repeat_py", [values], request_id="d0", enable_empty_final_response=True)
        while True:
            result, error = answers.get(timeout=60)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    (trace,) = traces(trace_file)
    assert trace["request_id"] == "d0" and [s["name"] for s in trace["stamps"]] == ORDER


def test_a_trace_file_that_cannot_be_written_costs_traces_not_requests(repo, tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    settings = parse_trace_config([f"triton,file={folder / 'trace.json'}", "triton,log-frequency=1",
                                   "level=TIMESTAMPS", "rate=1"])
    with running_server(repo, trace=settings) as server:
        folder.rmdir()  # gone while the server traces
        http = httpclient.InferenceServerClient(server.http_url)
        for i in range(2):
            add_sub(http, httpclient, f"x{i}")  # answered, though their traces cannot be written
        assert server.server.dataplane.tracer.lost == 2
    with pytest.raises(SpecError, match="does not exist"):
        parse_trace_config([f"triton,file={tmp_path / 'nowhere' / 'trace.json'}"])
