"""Triton's trace extension (serve/trace.py): the settings over HTTP and gRPC as tritonclient sets them,
global and per model; the traces a sampled request leaves in the trace file, in Triton's JSON, their
timestamps in order, the front-end's receive and send times included, an ensemble's steps as its child
traces; the same requests traced by real Triton; each bad setting the client's 400 (501 where Triton
has the feature and azulite not) naming it. Real Triton's own answers to the same settings:
tests/serve/test_metadata_triton.py."""

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
from azulite.serve.trace_settings import TraceSettings, parse_trace_config

from .conftest import MODELS_DIR as MODELS
from .conftest import build_model_repository
from .frontends import running_server

#: the data plane's timestamps of a batched model's request, in the order taken
DATA_PLANE = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
              "COMPUTE_END", "INFER_RESPONSE_COMPLETE", "REQUEST_END"]
#: the same request's trace as each front-end leaves it
ORDER = {"HTTP": ["HTTP_RECV_START", "HTTP_RECV_END", *DATA_PLANE, "HTTP_SEND_START", "HTTP_SEND_END"],
         "GRPC": ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", *DATA_PLANE, "GRPC_SEND_START", "GRPC_SEND_END"]}
#: a traced ensemble request's own timestamps (its steps are traces of their own)
ENSEMBLE = ["REQUEST_START", "QUEUE_START", "INFER_RESPONSE_COMPLETE", "REQUEST_END"]


def ensemble_of_two(repo) -> None:
    """``ens_py``: add_sub_py twice in a chain (the real Triton here has only the Python backend)."""
    config = ((MODELS / "add_sub_ensemble" / "config.pbtxt").read_text().replace("add_sub_ensemble", "ens_py")
              .replace('"add_sub_onnx"', '"add_sub_py"'))
    (repo / "ens_py" / "1").mkdir(parents=True)
    (repo / "ens_py" / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = build_model_repository(tmp_path_factory.mktemp("trace"), ("add_sub_py", "string_py", "bls_trace_py"))
    ensemble_of_two(root)
    return root


def add_sub(client, lib, request_id: str, model: str = "add_sub_py", headers: dict | None = None) -> None:
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    names = ("INPUT0",) if model == "bls_trace_py" else ("INPUT0", "INPUT1")
    inputs = [lib.InferInput(name, [1, 16], "FP32") for name in names]
    for tensor in inputs:
        tensor.set_data_from_numpy(x)
    result = client.infer(model, inputs, request_id=request_id, headers=headers)
    # ens_py: (x + x) + (x - x); bls_trace_py: two BLS calls' x + x, added
    assert np.array_equal(result.as_numpy("OUTPUT0"), 4 * x if model == "bls_trace_py" else x + x)


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
        # written once log_frequency (2) traces were collected, the second once its answer was sent
        wait_for(lambda: (tmp_path / "trace.json.0").exists(), "the first trace file")
        first = traces(tmp_path / "trace.json.0")
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
        assert names == ORDER["GRPC" if trace["request_id"].startswith("g") else "HTTP"], names
        times = [s["ns"] for s in trace["stamps"]]
        assert times == sorted(times) and times[0] > 0, times
    assert len({t["id"] for t in first + rest}) == 5


def test_bad_trace_settings_name_what_is_wrong(repo, tmp_path):
    with running_server(repo) as server:  # no trace file given at start
        http = httpclient.InferenceServerClient(server.http_url)
        before = http.get_trace_settings()
        for settings, status, words in (
            ({"trace_level": ["TIMESTAMPS"]}, "400", "trace file name is not given"),
            ({"trace_rate": "-1"}, "400", "Expecting value >= 0"),
            ({"trace_count": "x"}, "400", "Unable to parse 'trace_count', got: x"),
            ({"trace_count": "-2"}, "400", "Expecting value >= -1"),
            ({"log_frequency": "-1"}, "400", "Expecting value >= 0"),
            ({"trace_level": ["LOUD"]}, "400", "unknown level(s) ['LOUD']"),
            ({"trace_level": ["TENSORS"]}, "400", "trace file name is not given"),
            ({"trace_mode": "opentelemetry"}, "501", "the trace mode is chosen at start"),
            ({"trace_mode": "zipkin"}, "400", "must be \"triton\" or \"opentelemetry\""),
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
                         (["rate=-1"], "Expecting value >= 0")):
        with pytest.raises(SpecError, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
            parse_trace_config(flags)


def wait_for(condition, what: str, timeout_s: float = 120) -> None:
    """Poll ``condition`` until it holds (a file the server writes when the event happened)."""
    import time

    deadline = time.monotonic() + timeout_s  # a safety net: the condition is what is waited on
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout_s} s"
        time.sleep(0.05)


def test_workers_share_one_tracer_and_shutdown_writes_the_rest(tmp_path):
    """``azulite serve --workers 2`` started tracing (``--trace-config``): requests through either front-end
    are traced by the model host, each with its front-end's receive and send times (the send reported by
    the front-end process to the host, which writes the trace then: log_frequency 1), a change through a
    front-end is what every front-end answers, and a SIGTERM writes the traces still held to
    ``trace_file`` (log_frequency 0)."""
    import signal

    from tests.cli.test_serve import Served

    repo = build_model_repository(tmp_path / "repo", ("add_sub_py",))
    trace_file = tmp_path / "trace.json"
    served = Served(str(repo), "--workers", "2", "--trace-config", f"triton,file={trace_file}",
                    "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1",
                    "--trace-config", "log-frequency=1")
    try:
        url, grpc_url = f"127.0.0.1:{served.ports['HTTPService']}", f"127.0.0.1:{served.ports['GRPCInferenceService']}"
        for i in range(3):
            http = httpclient.InferenceServerClient(url)  # a new connection each: either front-end
            add_sub(http, httpclient, f"w{i}")
            http.close()
        client = grpcclient.InferenceServerClient(grpc_url)
        add_sub(client, grpcclient, "g0")
        client.close()
        # each trace is written once its front-end reported the send: four files, in the order sent
        wait_for(lambda: (tmp_path / "trace.json.3").exists(), "the fourth trace's file")
        sent = [t for i in range(4) for t in traces(tmp_path / f"trace.json.{i}")]
        assert sorted(t["request_id"] for t in sent) == ["g0", "w0", "w1", "w2"]
        for trace in sent:
            names = [s["name"] for s in trace["stamps"]]
            assert names == ORDER["GRPC" if trace["request_id"] == "g0" else "HTTP"], names
        http = httpclient.InferenceServerClient(url)
        assert http.update_trace_settings(settings={"log_frequency": "0"})["log_frequency"] == "0"
        for _ in range(4):
            again = grpcclient.InferenceServerClient(grpc_url)
            assert again.get_trace_settings(as_json=True)["settings"]["log_frequency"]["value"] == ["0"]
            again.close()
        add_sub(http, httpclient, "held")  # traced, and written only when the server stops
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(120) == 0
    finally:
        served.stop()
    (written,) = traces(trace_file)  # what was buffered when the server stopped
    assert written["request_id"] == "held"
    # its send may or may not have reached the host before SIGTERM: the data plane's part is there
    assert [s["name"] for s in written["stamps"]][:10] == ORDER["HTTP"][:10]
    with pytest.raises(SpecError, match="does not exist"):
        parse_trace_config([f"triton,file={tmp_path / 'nowhere' / 'trace.json'}"])


def test_a_trace_reads_as_real_tritons(repo, tmp_path):
    """The same requests traced by real Triton 2.51 and by azulite: the same header fields and the same
    timestamps (front-end, data plane, response; none for a step's or a BLS call's response, which goes to
    its caller); an ensemble request's steps as child traces with its ``parent_id`` and request id, a BLS
    call given the request's trace (``request.trace()``) as its child, one given none not traced, each
    child written before its parent; no ``request_id`` where the request has none. Kept different:
    Triton's Python backend completes the response inside the model's execute, so its
    INFER_RESPONSE_COMPLETE comes before COMPUTE_END, azulite's after it; and its GRPC_WAITREAD_START is
    when the call's read was posted, azulite's when the call's headers came."""
    from .anchor import running_triton

    def send(http_url: str, grpc_url: str) -> None:
        http = httpclient.InferenceServerClient(http_url)
        add_sub(http, httpclient, "t0")
        add_sub(grpcclient.InferenceServerClient(grpc_url), grpcclient, "t1")
        add_sub(http, httpclient, "t2", model="ens_py")
        add_sub(http, httpclient, "t3", model="bls_trace_py")
        add_sub(http, httpclient, "")  # no request id

    written = {}
    for side in ("triton", "azulite"):
        trace_file = tmp_path / side / "trace.json"
        trace_file.parent.mkdir()
        flags = [f"triton,file={trace_file}", "triton,log-frequency=1", "level=TIMESTAMPS", "rate=1"]
        if side == "triton":
            with running_triton(repo, tmp_path / "triton.log", args=tuple(f"--trace-config={f}" for f in flags)) as t:
                send(t.http_url, t.grpc_url)
                # Triton writes a trace once its front-end released it: wait for the last file
                wait_for(lambda: trace_file.with_name("trace.json.4").exists(), "Triton's fifth trace file")
        else:
            with running_server(repo, trace=parse_trace_config(flags)) as server:
                send(server.http_url, server.grpc_url)
        written[side] = [traces(trace_file.with_name(f"trace.json.{i}")) for i in range(5)]
    theirs, ours = written["triton"], written["azulite"]

    def heads(files):
        return [[(t["model_name"], t["model_version"], t.get("request_id"), "parent_id" in t) for t in f]
                for f in files]

    assert heads(theirs) == heads(ours) == [
        [("add_sub_py", 1, "t0", False)], [("add_sub_py", 1, "t1", False)],
        [("add_sub_py", 1, "t2", True), ("add_sub_py", 1, "t2", True), ("ens_py", 1, "t2", False)],
        [("add_sub_py", 1, None, True), ("bls_trace_py", 1, "t3", False)],
        [("add_sub_py", 1, None, False)]]
    for side in (theirs, ours):  # the children's parent is the ensemble's, the BLS caller's trace
        for file in side[2:4]:
            children, parent = file[:-1], file[-1]
            assert {t["parent_id"] for t in children} == {parent["id"]}
        assert len({t["id"] for file in side for t in file}) == 8
    for mine, real in (pair for files in zip(ours, theirs) for pair in zip(*files)):
        assert set(mine) == set(real)
        real_names = sorted(s["name"] for s in real["stamps"])
        assert sorted(s["name"] for s in mine["stamps"]) == real_names, real_names
    assert [s["name"] for s in ours[0][0]["stamps"]] == ORDER["HTTP"]
    assert [s["name"] for s in ours[1][0]["stamps"]] == ORDER["GRPC"]
    # a child's trace has no INFER_RESPONSE_COMPLETE: its response goes to its caller (as Triton's)
    child = [n for n in DATA_PLANE if n != "INFER_RESPONSE_COMPLETE"]
    assert [s["name"] for s in ours[2][0]["stamps"]] == [s["name"] for s in ours[3][0]["stamps"]] == child
    assert [s["name"] for s in ours[2][2]["stamps"]] == ["HTTP_RECV_START", "HTTP_RECV_END", *ENSEMBLE,
                                                          "HTTP_SEND_START", "HTTP_SEND_END"]
    assert [s["name"] for s in ours[3][1]["stamps"]] == ORDER["HTTP"]
    for trace in (t for file in ours for t in file):
        times = [s["ns"] for s in trace["stamps"]]
        assert times == sorted(times), trace


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
    names = [s["name"] for s in trace["stamps"]]
    # one INFER_RESPONSE_COMPLETE per response with data (the three values; the empty final one has none),
    # taken as each is sent, so among the batch's compute times; no front-end times on a stream
    assert trace["request_id"] == "d0" and names.count("INFER_RESPONSE_COMPLETE") == 3, names
    responses = "INFER_RESPONSE_COMPLETE"
    assert [n for n in names if n != responses] == [n for n in DATA_PLANE if n != responses]
    assert names[0] == "REQUEST_START" and names[-1] == "REQUEST_END"


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
        # each written (and lost) once its answer was sent
        wait_for(lambda: server.server.dataplane.tracer.lost == 2, "two lost traces")
    with pytest.raises(SpecError, match="does not exist"):
        parse_trace_config([f"triton,file={tmp_path / 'nowhere' / 'trace.json'}"])


def test_a_held_trace_is_written_when_sent_or_at_shutdown_and_steps_do_not_count(tmp_path):
    """The tracer alone (serve/trace.py): a trace whose front-end sends the answer waits for the send (its
    times last; 0, 0: nothing was sent, no send times), one never reported is written at close, a second
    report changes nothing, and an ensemble's step traces go with their parent without counting toward the
    log frequency or the trace count."""
    from azulite.serve.trace import Tracer

    tracer = Tracer(parse_trace_config([f"triton,file={tmp_path / 't.json'}", "triton,log-frequency=2",
                                        "level=TIMESTAMPS", "rate=1", "count=3"]))
    sent = tracer.sample("m", 1, "sent")
    sent.received("HTTP", 10, 20)
    sent.ended()  # answered: held for the front-end's send
    parent = tracer.sample("ens", 1, "gone")
    parent.received("GRPC", 30, 40)
    step = parent.child("m", 1, "gone")
    step.ended()
    parent.ended()
    assert not list(tmp_path.iterdir())  # nothing complete yet: the steps alone count for nothing
    parent.sent(0, 0)  # the client was gone: no send times
    sent.sent(50, 60)
    sent.sent(70, 80)  # reported again: nothing changes
    failed = tracer.sample("m", 1, "failed")
    failed.received("HTTP", 90, 95)
    failed.ended(answered=False)  # an error the data plane raised: nothing held
    held = tracer.sample("m", 1, "held")
    assert held is None  # count=3 reached: tracing stopped
    first = traces(tmp_path / "t.json.0")  # two top-level traces, the step's before its parent
    assert [(t["request_id"], t.get("parent_id")) for t in first] == [
        ("gone", parent.id), ("gone", None), ("sent", None)]
    by_id = {t["id"]: [s["name"] for s in t["stamps"]] for t in first}
    assert by_id[sent.id] == ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "REQUEST_END",
                              "HTTP_SEND_START", "HTTP_SEND_END"]
    assert by_id[parent.id] == ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "REQUEST_START", "REQUEST_END"]
    assert by_id[step.id] == ["REQUEST_START", "REQUEST_END"]
    assert [s["ns"] for s in next(t for t in first if t["id"] == sent.id)["stamps"]][-2:] == [50, 60]
    late = Tracer(parse_trace_config([f"triton,file={tmp_path / 'u.json'}", "level=TIMESTAMPS", "rate=1"]))
    never = late.sample("m", 1, "never")
    never.received("HTTP", 1, 2)
    never.ended()
    late.close()  # its front-end never reported: written at shutdown all the same
    assert [s["name"] for s in traces(tmp_path / "u.json")[0]["stamps"]] == [
        "HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "REQUEST_END"]
    tracer.close()  # the third, buffered, goes to the next file
    (last,) = traces(tmp_path / "t.json.1")
    assert last["request_id"] == "failed" and [s["name"] for s in last["stamps"]] == [
        "HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "REQUEST_END"]


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")  # the model's inf - inf
def test_the_tensors_level_reads_as_real_tritons(repo, tmp_path):
    """``level=TENSORS`` (with TIMESTAMPS, then alone) on real Triton and on azulite for the same requests:
    each trace's TENSOR_QUEUE_INPUT (the request's inputs) and TENSOR_BACKEND_OUTPUT (the outputs asked for)
    activities equal, numbers written as Triton writes them (six significant digits, -0, nan, -nan, inf),
    strings quoted; an ensemble's steps and a traced BLS call with their own; with TENSORS alone, no header
    and no timestamps."""
    from .anchor import running_triton

    x = np.array([[0.5, 1e-7, 123456.789, -3.25, 1e20, 0.1, 2.0, -0.0, np.nan, np.inf, 7, 8, 9, 10, 11, 1 / 3]],
                 np.float32)

    def send(http_url: str) -> None:
        http = httpclient.InferenceServerClient(http_url)
        inputs = [httpclient.InferInput(name, [1, 16], "FP32") for name in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(x)
        http.infer("add_sub_py", inputs, request_id="f0", outputs=[httpclient.InferRequestedOutput("OUTPUT1")])
        text = httpclient.InferInput("TEXT", [1, 3], "BYTES")
        text.set_data_from_numpy(np.array([["ab", "c,d", "ünï"]], dtype=object))
        http.infer("string_py", [text], request_id="s0")
        add_sub(http, httpclient, "e0", model="ens_py")
        add_sub(http, httpclient, "b0", model="bls_trace_py")
        http.update_trace_settings(settings={"trace_level": ["TENSORS"]})
        add_sub(http, httpclient, "t0")

    written = {}
    for side in ("triton", "azulite"):
        trace_file = tmp_path / side / "trace.json"
        trace_file.parent.mkdir()
        flags = [f"triton,file={trace_file}", "triton,log-frequency=1", "level=TIMESTAMPS", "level=TENSORS", "rate=1"]
        if side == "triton":
            with running_triton(repo, tmp_path / "triton.log", args=tuple(f"--trace-config={f}" for f in flags)) as t:
                send(t.http_url)
                wait_for(lambda: trace_file.with_name("trace.json.4").exists(), "Triton's fifth trace file")
        else:
            with running_server(repo, trace=parse_trace_config(flags)) as server:
                send(server.http_url)
        written[side] = [json.loads(trace_file.with_name(f"trace.json.{i}").read_text()) for i in range(5)]

    def tensors(objects: list[dict], ordered: bool = True) -> dict[int, list]:
        by_id: dict[int, list] = {}
        for obj in objects:
            if "activity" in obj:
                by_id.setdefault(obj["id"], []).append((obj["activity"], obj["tensor"]))
        return by_id if ordered else {i: sorted(a, key=json.dumps) for i, a in by_id.items()}

    for theirs, ours in zip(written["triton"], written["azulite"]):
        # Triton lists an ensemble's and its steps' tensors in its hash maps' order: compared as sets
        assert tensors(ours, ordered=False) == tensors(theirs, ordered=False)
        assert {tuple(sorted(o)) for o in ours} == {tuple(sorted(o)) for o in theirs}  # the same kinds of object
    assert tensors(written["azulite"][0]) == tensors(written["triton"][0])  # a request's: in its order
    first = tensors(written["azulite"][0])[1]
    assert first[0][1]["data"] == "0.5,1e-07,123457,-3.25,1e+20,0.1,2,-0,nan,inf,7,8,9,10,11,0.333333"
    assert [(activity, tensor["name"]) for activity, tensor in first] == [
        ("TENSOR_QUEUE_INPUT", "INPUT0"), ("TENSOR_QUEUE_INPUT", "INPUT1"), ("TENSOR_BACKEND_OUTPUT", "OUTPUT1")]
    assert all(set(o) == {"id", "activity", "tensor"} for o in written["azulite"][4])  # TENSORS alone
