"""Triton's opentelemetry trace mode (serve/otel.py): the spans azulite exports over OTLP/HTTP for the same
requests as real Triton 2.51 (HTTP, gRPC, an ensemble, a BLS call given the request's trace, a request
carrying a W3C trace context), received by a local OTLP/HTTP endpoint (the stand-in for a collector:
none can be installed here) and compared span for span; the mode's settings over the protocol and the
command line; ``--workers`` (the trace context crosses to the model host)."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from tritonclient.utils import InferenceServerException

from azulite.errors import SpecError
from azulite.serve.trace_settings import parse_trace_config

from .conftest import build_model_repository
from .frontends import running_server
from .test_trace import add_sub, ensemble_of_two, wait_for

#: a caller's span (W3C trace context): the request's spans join its trace, under it
TRACE_ID, CALLER_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"


class Receiver:
    """An OTLP/HTTP endpoint: the spans POSTed to /v1/traces (protobuf, or OTLP's JSON as Triton's C++
    exporter sends it), each as a dict with hex ids."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.resources: list[dict] = []
        self.lock = threading.Lock()

    def take(self, body: bytes, content_type: str) -> None:
        if "json" in content_type:
            doc = json.loads(body)
            hexed = True
        else:
            doc = MessageToDict(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            hexed = False
        for group in doc.get("resourceSpans", []):
            resource = {a["key"]: _value(a["value"]) for a in group.get("resource", {}).get("attributes", [])}
            for scope in group.get("scopeSpans", []):
                for span in scope.get("spans", []):
                    ids = {k: (span.get(k, "") if hexed else base64.b64decode(span.get(k, "")).hex())
                           for k in ("traceId", "spanId", "parentSpanId")}
                    with self.lock:
                        self.resources.append(resource)
                        self.spans.append({
                            **ids, "name": span["name"], "kind": span.get("kind"),
                            "start": int(span["startTimeUnixNano"]), "end": int(span["endTimeUnixNano"]),
                            "attributes": {a["key"]: _value(a["value"]) for a in span.get("attributes", [])},
                            "events": [(e["name"], int(e["timeUnixNano"])) for e in span.get("events", [])]})

    def roots(self) -> int:
        with self.lock:
            return sum(1 for s in self.spans if s["name"] == "InferRequest")


def _value(value: dict):
    return next(iter(value.values()))


@contextmanager
def otlp_endpoint() -> Iterator[tuple[str, Receiver]]:
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            receiver.take(body, self.headers.get("Content-Type", ""))
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1/traces", receiver
    finally:
        server.shutdown()
        server.server_close()


def trees(spans: list[dict]) -> dict[str, dict]:
    """request id -> its trace as a tree: (name, attributes without the per-run ids, event names, children)
    from its InferRequest span down; and the root's trace and parent ids."""
    by_parent: dict[str, list[dict]] = {}
    for span in spans:
        by_parent.setdefault(span["parentSpanId"], []).append(span)

    def node(span: dict) -> tuple:
        kids = sorted((node(k) for k in by_parent.get(span["spanId"], []) if k["traceId"] == span["traceId"]),
                      key=repr)
        return (span["name"], tuple(sorted(span["attributes"].items())), tuple(e[0] for e in span["events"]),
                tuple(kids))

    out = {}
    for root in (s for s in spans if s["name"] == "InferRequest"):
        model = next(k for k in by_parent.get(root["spanId"], []) if k["traceId"] == root["traceId"])
        out[model["attributes"].get("triton.request_id", "")] = {
            "tree": node(root), "trace_id": root["traceId"], "parent": root["parentSpanId"]}
    return out


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = build_model_repository(tmp_path_factory.mktemp("otel"), ("add_sub_py", "bls_trace_py"))
    ensemble_of_two(root)
    return root


def send(http_url: str, grpc_url: str) -> None:
    http = httpclient.InferenceServerClient(http_url)
    grpc_client = grpcclient.InferenceServerClient(grpc_url)
    add_sub(http, httpclient, "h0")
    add_sub(grpc_client, grpcclient, "g0")
    add_sub(http, httpclient, "e0", model="ens_py")
    add_sub(http, httpclient, "b0", model="bls_trace_py")
    add_sub(http, httpclient, "p0", headers={"traceparent": TRACEPARENT})
    add_sub(grpc_client, grpcclient, "q0", headers={"traceparent": TRACEPARENT})


def flags(url: str, *more: str) -> list[str]:
    return ["mode=opentelemetry", f"opentelemetry,url={url}", "level=TIMESTAMPS", "rate=1",
            "opentelemetry,bsp_schedule_delay=50", *more]


def test_spans_read_as_real_tritons(repo, tmp_path):
    """The same six requests traced by real Triton and by azulite in the opentelemetry mode: per request the
    same span tree (InferRequest > model > compute; an ensemble's steps and a traced BLS call under their
    caller's model span), the same attributes (model, version, trace id, parent trace id, request id) and
    events; a request that carried a traceparent is in the caller's trace, under the caller's span. Kept
    different: the resource's service.name (Triton's "triton-inference-server", azulite's "azulite"); and
    azulite joins a gRPC call's traceparent every time (Triton 2.51 not always)."""
    from .anchor import running_triton

    seen = {}
    with otlp_endpoint() as (url, receiver):
        args = tuple(f"--trace-config={f}" for f in flags(url))
        with running_triton(repo, tmp_path / "triton.log", args=args) as triton:
            send(triton.http_url, triton.grpc_url)
            wait_for(lambda: receiver.roots() == 6, "Triton's six InferRequest spans")
        seen["triton"] = receiver.spans, receiver.resources
    with otlp_endpoint() as (url, receiver):
        with running_server(repo, trace=parse_trace_config(flags(url))) as server:
            send(server.http_url, server.grpc_url)
        # the server's shutdown flushed its span processor: every span is in
        seen["azulite"] = receiver.spans, receiver.resources
    theirs, ours = trees(seen["triton"][0]), trees(seen["azulite"][0])
    assert sorted(ours) == sorted(theirs) == ["b0", "e0", "g0", "h0", "p0", "q0"]
    for request_id in ours:
        assert ours[request_id]["tree"] == theirs[request_id]["tree"], request_id
    # the caller's trace and span, over HTTP and gRPC; real Triton 2.51 joins a gRPC call's traceparent only
    # some of the time (its q0 started a trace of its own in 2 of 7 runs here): its gRPC one is not compared
    for request_id, name, side in (("p0", "ours", ours), ("p0", "theirs", theirs), ("q0", "ours", ours)):
        assert (side[request_id]["trace_id"], side[request_id]["parent"]) == (TRACE_ID, CALLER_SPAN), (
            request_id, name)
    assert len({ours[r]["trace_id"] for r in ("h0", "g0", "e0", "b0")}) == 4  # each request its own trace
    assert {r["service.name"] for r in seen["triton"][1]} == {"triton-inference-server"}
    assert {r["service.name"] for r in seen["azulite"][1]} == {"azulite"}
    # azulite's spans: children inside their parents, events inside their span, on the wall clock
    spans = {s["spanId"]: s for s in seen["azulite"][0]}
    for span in spans.values():
        parent = spans.get(span["parentSpanId"])
        if parent is not None:
            assert parent["start"] <= span["start"] <= span["end"] <= parent["end"], (parent, span)
        assert all(span["start"] <= t <= span["end"] for _, t in span["events"]), span


def test_settings_of_the_opentelemetry_mode(repo, tmp_path):
    """GET answers the mode's settings as Triton's (no trace file, no log frequency); what is chosen at start
    cannot be changed (501) and the triton mode's settings are refused (400); a rate of 0 traces only the
    requests that carry a trace context (as Triton's); ``resource`` names the service."""
    with otlp_endpoint() as (url, receiver):
        settings = parse_trace_config(flags(url, "opentelemetry,resource=service.name=ranker",
                                            "opentelemetry,resource=deployment.environment=test"))
        with running_server(repo, trace=settings) as server:
            http = httpclient.InferenceServerClient(server.http_url)
            assert http.get_trace_settings() == {
                "trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1", "trace_mode": "opentelemetry",
                "url": url, "bsp_schedule_delay": "50", "bsp_max_export_batch_size": "512",
                "bsp_max_queue_size": "2048"}
            for change, status, words in (
                ({"url": "http://elsewhere:4318/v1/traces"}, "501", "can not be updated through network protocol"),
                ({"trace_mode": "triton"}, "501", "the trace mode is chosen at start"),
                ({"trace_file": "/tmp/t.json"}, "400", "a setting of the triton trace mode"),
                ({"log_frequency": "5"}, "400", "a setting of the triton trace mode"),
            ):
                with pytest.raises(InferenceServerException) as info:
                    http.update_trace_settings(settings=change)
                assert info.value.status() == status and words in info.value.message(), (change, info.value)
            assert http.update_trace_settings(settings={"trace_rate": "0", "url": url})["trace_rate"] == "0"
            add_sub(http, httpclient, "not-sampled")
            add_sub(http, httpclient, "carried", headers={"traceparent": TRACEPARENT})
        assert {s["attributes"].get("triton.request_id") for s in receiver.spans} == {None, "carried"}
        assert {r["service.name"] for r in receiver.resources} == {"ranker"}
        assert {r["deployment.environment"] for r in receiver.resources} == {"test"}


def test_trace_config_flags_of_the_opentelemetry_mode(tmp_path):
    settings = parse_trace_config(["mode=opentelemetry", "opentelemetry,url=http://c:4318/v1/traces", "rate=0",
                                   "opentelemetry,bsp_max_queue_size=64", "opentelemetry,bsp_max_export_batch_size=8"])
    assert (settings.mode, settings.rate, settings.otel.url, settings.otel.bsp_max_queue_size) == (
        "opentelemetry", 0, "http://c:4318/v1/traces", 64)
    for items, words in (
        (["opentelemetry,url=http://c:4318/v1/traces"], "need the opentelemetry mode"),
        (["mode=opentelemetry", "triton,file=/tmp/t.json"], "the triton mode's"),
        (["mode=opentelemetry", "opentelemetry,resource=service.name"], "is not KEY=VALUE"),
        (["mode=opentelemetry", "opentelemetry,bsp_max_export_batch_size=4096"], "must not exceed"),
        (["mode=opentelemetry", "opentelemetry,bsp_schedule_delay=soon"], "Unable to parse"),
        (["mode=opentelemetry", "opentelemetry,endpoint=x"], "unknown opentelemetry setting 'endpoint'"),
        (["mode=jaeger"], "must be \"triton\" or \"opentelemetry\""),
    ):
        with pytest.raises(SpecError, match=words):
            parse_trace_config(items)


def test_workers_export_spans_with_the_callers_context(tmp_path):
    """``azulite serve --workers 2`` in the opentelemetry mode: requests through either front-end, over HTTP
    and gRPC, carry their trace context and front-end times to the model host, which exports their spans."""
    import signal

    from tests.cli.test_serve import Served

    repo = build_model_repository(tmp_path / "repo", ("add_sub_py",))
    with otlp_endpoint() as (url, receiver):
        served = Served(str(repo), "--workers", "2", *(a for f in flags(url) for a in ("--trace-config", f)))
        try:
            for i in range(2):
                http = httpclient.InferenceServerClient(f"127.0.0.1:{served.ports['HTTPService']}")
                add_sub(http, httpclient, f"w{i}", headers={"traceparent": TRACEPARENT})
                http.close()
            grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.ports['GRPCInferenceService']}")
            add_sub(grpc_client, grpcclient, "wg", headers={"traceparent": TRACEPARENT})
            grpc_client.close()
            # each trace is exported once its front-end reported the send (then within bsp_schedule_delay)
            wait_for(lambda: receiver.roots() == 3, "three InferRequest spans")
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(120) == 0
        finally:
            served.stop()
        found = trees(receiver.spans)
    assert sorted(found) == ["w0", "w1", "wg"]
    for request_id, trace in found.items():
        assert trace["trace_id"] == TRACE_ID and trace["parent"] == CALLER_SPAN
        front = "GRPC" if request_id == "wg" else "HTTP"
        events = trace["tree"][2]
        assert events[0].startswith(front) and events[-1] == f"{front}_SEND_END", events
        (model,) = trace["tree"][3]
        assert model[0] == "add_sub_py" and [k[0] for k in model[3]] == ["compute"]
