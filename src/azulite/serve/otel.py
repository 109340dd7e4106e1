"""Triton's ``opentelemetry`` trace mode (``--trace-config mode=opentelemetry``): each sampled request's
trace (serve/trace.py) exported as OpenTelemetry spans over OTLP/HTTP, by the OpenTelemetry SDK's batch
span processor and OTLP exporter, in the shape Triton 2.51 exports (probed against it, tests/serve/
test_otel.py):

- an ``InferRequest`` span per request (its front-end's receive and send, ``INFER_RESPONSE_COMPLETE``), the
  child of the caller's span when the request carried a W3C ``traceparent`` (HTTP header or gRPC metadata);
- under it a span named after the model (``REQUEST_START``, ``QUEUE_START``, ``REQUEST_END``; attributes
  ``triton.model_name``, ``triton.model_version``, ``triton.trace_id``, ``triton.trace_parent_id`` and
  ``triton.request_id`` when the request has one), and under that a ``compute`` span (``COMPUTE_START``,
  ``COMPUTE_INPUT_END``, ``COMPUTE_OUTPUT_START``, ``COMPUTE_END``) when the model computed;
- an ensemble's steps and the BLS calls given the request's trace: model spans (with their compute spans)
  under their caller's model span.

Timestamps are the trace's monotonic ones moved onto the wall clock (OpenTelemetry's time base, as
Triton's spans are). The exporter's settings are Triton's: ``url``, ``resource`` (``key=value``, also
``OTEL_RESOURCE_ATTRIBUTES``), ``bsp_max_queue_size``, ``bsp_schedule_delay`` (ms),
``bsp_max_export_batch_size``; set at start, not through the protocol (as Triton).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from azulite.errors import SpecError

if TYPE_CHECKING:
    from azulite.serve.trace import Trace

log = logging.getLogger("azulite.serve.otel")

DEFAULT_URL = "http://localhost:4318/v1/traces"  # Triton's, the OTLP/HTTP default
_FRONT = ("HTTP_RECV_START", "HTTP_RECV_END", "GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "INFER_RESPONSE_COMPLETE",
          "HTTP_SEND_START", "HTTP_SEND_END", "GRPC_SEND_START", "GRPC_SEND_END")
_MODEL = ("REQUEST_START", "QUEUE_START", "REQUEST_END")


@dataclass(frozen=True)
class OtelSettings:
    url: str = DEFAULT_URL
    #: resource attributes; service.name defaults to "azulite" (Triton's: "triton-inference-server")
    resource: tuple[tuple[str, str], ...] = ()
    bsp_max_queue_size: int = 2048
    bsp_schedule_delay: int = 5000  # ms between exports
    bsp_max_export_batch_size: int = 512

    def as_json(self) -> dict[str, str]:
        """As Triton's trace settings answer them (strings)."""
        return {"url": self.url, "bsp_schedule_delay": str(self.bsp_schedule_delay),
                "bsp_max_export_batch_size": str(self.bsp_max_export_batch_size),
                "bsp_max_queue_size": str(self.bsp_max_queue_size)}


def traceparent_of(pairs) -> dict[str, str] | None:
    """The W3C trace context (``traceparent``, ``tracestate``) among a request's (name, value) headers or
    gRPC metadata, for the propagator; None when there is none."""
    context = None
    for name, value in pairs:
        name = name.decode("latin-1") if isinstance(name, bytes) else name
        if name in ("traceparent", "tracestate"):
            if context is None:
                context = {}
            context[name] = value.decode("latin-1") if isinstance(value, bytes) else value
    return context if context and "traceparent" in context else None


class OtelExporter:
    """Turns finished traces into spans and hands them to the SDK's batch span processor (its own thread
    exports them); :meth:`close` flushes what is queued."""

    def __init__(self, settings: OtelSettings) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise SpecError("the opentelemetry trace mode needs the OTLP/HTTP span exporter, which is not installed",
                            field="--trace-config mode=opentelemetry",
                            fix="pip install 'azulite[otel]' (opentelemetry-exporter-otlp-proto-http at the version "
                                "of the installed opentelemetry-sdk)") from None
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        attributes = {"service.name": "azulite", **dict(settings.resource)}
        self._provider = TracerProvider(resource=Resource.create(attributes))  # OTEL_RESOURCE_ATTRIBUTES too
        self._provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=settings.url), max_queue_size=settings.bsp_max_queue_size,
            schedule_delay_millis=settings.bsp_schedule_delay,
            max_export_batch_size=settings.bsp_max_export_batch_size))
        self._tracer = self._provider.get_tracer("azulite.serve")
        self._server, self._in = SpanKind.SERVER, set_span_in_context
        self._propagator = TraceContextTextMapPropagator()

    def export(self, trace: Trace) -> None:
        """One top-level trace (its children on ``trace.children``) as its spans."""
        # the trace's clock -> the wall clock, read per trace: an offset kept from start would drift from
        # the wall clock as NTP adjusts it over a long-running server's life
        wall = time.time_ns() - time.monotonic_ns()
        stamps = trace.stamps
        parent = None if trace.context is None else self._propagator.extract(trace.context)
        root = self._tracer.start_span("InferRequest", context=parent, kind=self._server,
                                       start_time=stamps[0][1] + wall)
        for name, ns in stamps:
            if name in _FRONT:
                root.add_event(name, timestamp=ns + wall)
        self._model_span(trace, self._in(root), wall)
        root.end(end_time=stamps[-1][1] + wall)

    def _model_span(self, trace: Trace, context: Any, wall: int) -> None:
        times = {name: ns for name, ns in trace.stamps}
        attributes = {"triton.model_name": trace.model, "triton.model_version": str(trace.version),
                      "triton.trace_id": str(trace.id), "triton.trace_parent_id": str(trace.parent_id)}
        if trace.request_id:
            attributes["triton.request_id"] = trace.request_id
        start = times.get("REQUEST_START", trace.stamps[0][1])
        span = self._tracer.start_span(trace.model, context=context, kind=self._server, start_time=start + wall,
                                       attributes=attributes)
        for name, ns in trace.stamps:
            if name in _MODEL:
                span.add_event(name, timestamp=ns + wall)
        inside = self._in(span)
        if "COMPUTE_START" in times:
            compute = self._tracer.start_span("compute", context=inside, kind=self._server,
                                              start_time=times["COMPUTE_START"] + wall)
            for name, ns in trace.stamps:
                if name.startswith("COMPUTE_"):
                    compute.add_event(name, timestamp=ns + wall)
            compute.end(end_time=times.get("COMPUTE_END", times["COMPUTE_START"]) + wall)
        for child in trace.children:
            self._model_span(child, inside, wall)
        span.end(end_time=times.get("REQUEST_END", trace.stamps[-1][1]) + wall)

    def close(self) -> None:
        try:
            self._provider.shutdown()  # exports what is queued (the processor's own timeout bounds it)
        except Exception as exc:  # noqa: BLE001 - a collector that is gone costs traces, never the shutdown
            log.warning("opentelemetry: exporting the last spans failed: %s", exc)
