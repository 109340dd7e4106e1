"""Triton's trace extension (``GET/POST v2[/models/NAME]/trace/setting``, gRPC ``TraceSetting``) and the
traces themselves: every ``trace_rate``-th request of a model whose ``trace_level`` holds ``TIMESTAMPS``
records when it started, was queued, computed (start, input end, output start, end) and ended, and the
traces go to ``trace_file`` in Triton's JSON (``${trace_file}.${i}`` every ``log_frequency`` traces,
or ``${trace_file}`` at shutdown when it is 0), which Triton's trace tools read.

The settings, the ``--trace-config`` flags and their checks: serve/trace_settings.py.

What a trace holds here, as Triton's (one clock, CLOCK_MONOTONIC): the front-end's receive and send times
(``HTTP_RECV_START``/``HTTP_RECV_END`` ... ``HTTP_SEND_START``/``HTTP_SEND_END``; over gRPC
``GRPC_WAITREAD_START``/``GRPC_WAITREAD_END`` from the call's headers to its request's end, and
``GRPC_SEND_START``/``GRPC_SEND_END``), then the data plane's (``REQUEST_START``, ``QUEUE_START``,
``COMPUTE_START``, ``COMPUTE_INPUT_END``, ``COMPUTE_OUTPUT_START``, ``COMPUTE_END``,
``INFER_RESPONSE_COMPLETE``, ``REQUEST_END``); the ``TENSORS`` level adds the request's inputs
(``TENSOR_QUEUE_INPUT``) and the outputs it asked for (``TENSOR_BACKEND_OUTPUT``), as Triton formats
them (the file only: the opentelemetry mode's spans carry timestamps). A traced ensemble request's
steps, and the BLS calls a Python model passes the request's trace to (``trace=request.trace()``), are
traces of their own with its ``parent_id`` (a step with its request id), always taken (not sampled, not
counted against ``trace_count``), written before it; a BLS call given no trace is not traced (Triton
samples at its front-ends only). A trace whose front-end sends its answer stays open after ``REQUEST_END`` until the
front-end reports the send (:meth:`Trace.sent`; with ``--workers`` a message from the front-end process to
the model host), and one the front-end never reports is written at shutdown. Not as Triton: a decoupled
model's stream has no front-end times (it ends at its final response), and the front-end times of the
grpcio server (``--grpc-impl grpcio``) are not taken. The data plane holds the tracer, so with
``--workers`` every front-end's settings call reaches the one tracer in the model host.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np

from azulite.errors import InvalidArgument, NotFound, Unsupported
from azulite.serve.config import numpy_to_wire
from azulite.serve.otel import OtelExporter
from azulite.serve.trace_settings import FIELDS, OTEL_FIELDS, TraceSettings, setting_value

log = logging.getLogger("azulite.serve.trace")
class TracedReply(tuple):
    """An HTTP reply (status, type, body, headers) whose request is traced: the front-end reports its send
    to ``trace`` once written (serve/http_server.py)."""

    trace: Any


#: the protocol's names of a front-end's receive and send times
_FRONT_STAMPS = {"HTTP": ("HTTP_RECV_START", "HTTP_RECV_END", "HTTP_SEND_START", "HTTP_SEND_END"),
                 "GRPC": ("GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "GRPC_SEND_START", "GRPC_SEND_END")}


class Trace:
    """One traced request: its header and timestamps, in the order they were taken. ``front``: the protocol
    ("HTTP", "GRPC") whose front-end reports its send (:meth:`sent`), "" when none will."""

    __slots__ = ("tracer", "scope", "id", "model", "version", "request_id", "stamps", "parent_id", "front",
                 "parent", "children", "context", "levels", "tensors")

    def __init__(self, tracer: Tracer, scope: str, trace_id: int, model: str, version: int, request_id: str,
                 parent: Trace | None = None) -> None:
        self.tracer, self.scope, self.id = tracer, scope, trace_id
        self.model, self.version, self.request_id = model, version, request_id
        self.stamps: list[tuple[str, int]] = []
        self.parent = parent
        self.parent_id = 0 if parent is None else parent.id
        self.front = ""
        self.children: list[Trace] = []  # the opentelemetry mode's: finished children, exported with this
        self.context: dict[str, str] | None = None  # the W3C trace context the request carried (opentelemetry)
        self.levels: tuple[str, ...] = ("TIMESTAMPS",)  # the settings' trace_level when sampled
        #: TENSORS level: (position among the stamps, activity, tensor) in the order taken
        self.tensors: list[tuple[int, str, dict[str, str]]] = []

    @property
    def wants_tensors(self) -> bool:
        return "TENSORS" in self.levels

    def tensor(self, activity: str, name: str, datatype: str, shape, array) -> None:
        """A TENSOR_QUEUE_INPUT or TENSOR_BACKEND_OUTPUT activity (the TENSORS level), as Triton writes it."""
        self.tensors.append((len(self.stamps), activity, {
            "name": name, "data": tensor_text(array, datatype), "shape": ",".join(str(d) for d in shape),
            "dtype": datatype}))

    def received(self, front: str, start_ns: int, end_ns: int) -> None:
        """The front-end's receive times, taken before the trace began: they go first."""
        names = _FRONT_STAMPS.get(front)
        if names is not None and start_ns:
            self.front = front
            self.stamps[:0] = [(names[0], start_ns), (names[1], end_ns)]

    def computed(self, queued_ns: int, start_ns: int, input_ns: int, output_ns: int, end_ns: int) -> None:
        self.stamps += [("QUEUE_START", queued_ns), ("COMPUTE_START", start_ns),
                        ("COMPUTE_INPUT_END", min(start_ns + input_ns, end_ns)),
                        ("COMPUTE_OUTPUT_START", max(end_ns - output_ns, start_ns + input_ns)), ("COMPUTE_END", end_ns)]

    def stamp(self, name: str) -> None:
        self.stamps.append((name, time.monotonic_ns()))

    def child(self, model: str, version: int, request_id: str) -> Trace:
        """The trace of one of this request's ensemble steps or BLS calls (Triton's ``parent_id``)."""
        return self.tracer.child(self, model, version, request_id)

    def ended(self, answered: bool = True) -> None:
        """The data plane is done with the request; the trace is written now, or once the front-end sent
        the answer (``answered``: the data plane answered it, so the front-end has it to send)."""
        self.stamps.append(("REQUEST_END", time.monotonic_ns()))
        if answered and self.front:
            self.tracer.hold(self)
        else:
            self.tracer.finished(self)

    def sent(self, start_ns: int, end_ns: int) -> None:
        """The front-end wrote the answer (between the two times; 0, 0: it could not, the client was gone)."""
        self.tracer.release(self.id, start_ns, end_ns)

    def objects(self) -> list[dict[str, Any]]:
        """Triton's JSON objects of this trace: its header and timestamps (TIMESTAMPS level), its tensor
        activities (TENSORS level) where they were taken among the timestamps."""
        objects: list[dict[str, Any]] = []
        timestamps = "TIMESTAMPS" in self.levels
        if timestamps:
            head: dict[str, Any] = {"id": self.id, "model_name": self.model, "model_version": self.version}
            if self.request_id:  # as Triton's: left out when the request has none
                head["request_id"] = self.request_id
            if self.parent_id:
                head["parent_id"] = self.parent_id
            objects.append(head)
        tensors = iter(self.tensors)
        upcoming = next(tensors, None)
        for i, (name, ns) in enumerate(self.stamps):
            while upcoming is not None and upcoming[0] <= i:
                objects.append({"id": self.id, "activity": upcoming[1], "tensor": upcoming[2]})
                upcoming = next(tensors, None)
            if timestamps:
                objects.append({"id": self.id, "timestamps": [{"name": name, "ns": ns}]})
        while upcoming is not None:
            objects.append({"id": self.id, "activity": upcoming[1], "tensor": upcoming[2]})
            upcoming = next(tensors, None)
        return objects


def trace_tensors(trace: Trace, inputs: dict, outputs: dict) -> None:
    """An ensemble step's inputs and outputs (numpy arrays by name) as its trace's tensor activities."""
    for activity, arrays in (("TENSOR_QUEUE_INPUT", inputs), ("TENSOR_BACKEND_OUTPUT", outputs)):
        for name, array in arrays.items():
            trace.tensor(activity, name, numpy_to_wire(array.dtype), array.shape, array)


def tensor_text(array, datatype: str) -> str:
    """A tensor's elements as Triton's TENSORS level writes them: comma-separated, numbers as C++'s stream
    prints them (six significant digits, ``nan``/``-nan``/``inf``), BYTES elements each in double quotes
    (UTF-8; bytes that are not are escaped, where Triton writes them raw and its file is no longer JSON)."""
    flat = np.asarray(array).reshape(-1)
    if datatype == "BYTES":
        return ",".join('"' + (v if isinstance(v, str) else bytes(v).decode("utf-8", "backslashreplace")) + '"'
                        for v in flat)
    if flat.dtype.kind == "f":
        return ",".join(("-nan" if np.signbit(v) else "nan") if v != v else format(float(v), "g") for v in flat)
    if flat.dtype.kind == "b":
        return ",".join("1" if v else "0" for v in flat)
    return ",".join(str(int(v)) for v in flat)


class Tracer:
    """The server's trace settings (global and per model) and the traces being written."""

    def __init__(self, settings: TraceSettings | None = None, *, known_model=lambda name: True) -> None:
        self.global_settings = settings or TraceSettings()
        self.overrides: dict[str, dict[str, Any]] = {}  # model -> its own fields
        self.known_model = known_model
        self.active = False  # any scope traces: the data plane's one check per request
        self._effective: dict[str, TraceSettings] = {}
        self._seen: dict[str, int] = {}  # requests per scope ("" global, else the model)
        self._ids = itertools.count(1)  # trace ids, shared by top-level traces and their children
        self._buffers: dict[str, list[dict]] = {}  # trace file -> traces' objects not yet written
        self._buffered: dict[str, int] = {}  # trace file -> traces in its buffer
        self._index: dict[str, int] = {}  # trace file -> next ${file}.${i}
        self._held: dict[int, Trace] = {}  # id -> trace ended in the data plane, its front-end's send to come
        self._lock = threading.Lock()  # ended() may run on an instance's thread
        self.lost = 0  # traces a failed write of the trace file (or a failed export) lost
        #: the opentelemetry mode's span exporter (serve/otel.py), made at start as the mode is chosen then
        otel = self.global_settings.mode == "opentelemetry"
        self.exporter = OtelExporter(self.global_settings.otel) if otel else None
        self._refresh()

    # --- settings ---------------------------------------------------------------------------------

    def settings_for(self, model: str) -> TraceSettings:
        effective = self._effective.get(model)
        if effective is None:
            own = self.overrides.get(model)
            effective = replace(self.global_settings, **own) if own else self.global_settings
            self._effective[model] = effective
        return effective

    def setting(self, model: str = "", changes: dict[str, Any] | None = None) -> dict[str, Any]:
        """GET (``changes`` None) or POST the settings of one model ("": the global ones); the settings
        that then hold, as Triton answers them."""
        if model and not self.known_model(model):
            raise NotFound(f"Request for unknown model : {model}")
        if changes:
            if not isinstance(changes, dict):
                raise InvalidArgument("the trace settings must be a JSON object", fix='e.g. {"trace_rate": "100"}')
            fields: dict[str, Any] = {}
            cleared: list[str] = []
            otel = self.global_settings.mode == "opentelemetry"
            for name, value in changes.items():
                if otel and name in OTEL_FIELDS:
                    if value != OTEL_FIELDS[name](self.global_settings.otel):
                        raise Unsupported(f"the opentelemetry setting '{name}' can not be updated through network "
                                          "protocol", fix=f"start the server with --trace-config "
                                                          f"opentelemetry,{name}=...")
                    continue
                if name not in FIELDS:
                    raise InvalidArgument(f"unknown trace setting '{name}'; the settings are {', '.join(FIELDS)}")
                if otel and name in ("trace_file", "log_frequency"):
                    raise InvalidArgument(f"'{name}' is a setting of the triton trace mode; this server exports "
                                          "spans (the opentelemetry mode, chosen at start)")
                if name == "trace_mode" and value is not None and setting_value(name, value) != self.global_settings.mode:
                    raise Unsupported(f"the trace mode is chosen at start; this server's is "
                                      f"'{self.global_settings.mode}'", fix="restart it with --trace-config mode=...")
                if name == "trace_file":
                    if value != self.settings_for(model).file:
                        raise Unsupported("trace file location can not be updated through network protocol",
                                          fix="start the server with --trace-config triton,file=PATH")
                    continue
                if value is None:
                    if not model:
                        raise InvalidArgument(f"trace setting '{name}': a global setting cannot be cleared "
                                              "(a model's can: its global value then holds)")
                    cleared.append(FIELDS[name])
                    continue
                fields[FIELDS[name]] = setting_value(name, value)
            with self._lock:
                if model:
                    own = {k: v for k, v in self.overrides.get(model, {}).items() if k not in cleared}
                    own.update(fields)
                    candidate = replace(self.global_settings, **own)
                else:
                    candidate = replace(self.global_settings, **fields)
                if candidate.on and not candidate.file and not otel:  # Triton's words
                    raise InvalidArgument("Attempting to set invalid trace setting :trace file name is not given",
                                          fix="start the server with --trace-config triton,file=PATH")
                if model:
                    if own:
                        self.overrides[model] = own
                    else:
                        self.overrides.pop(model, None)
                else:
                    self.global_settings = candidate
                self._refresh()
        return self.settings_for(model).as_json()

    def _refresh(self) -> None:
        self._effective.clear()
        self.active = self.global_settings.on or any(self.settings_for(m).on for m in self.overrides)

    # --- traces -------------------------------------------------------------------------------------

    def sample(self, model: str, version: int, request_id: str, context: dict | None = None) -> Trace | None:
        """The request's trace when it is one the settings sample, else None. In the opentelemetry mode a
        request that carried a trace ``context`` is traced whatever the rate and count (as Triton's)."""
        settings = self.settings_for(model)
        if not settings.on:
            return None
        scope = model if model in self.overrides else ""
        if context is not None and self.exporter is not None:
            trace = self._start(settings.file, model, version, request_id, settings.level)
            trace.context = context
            return trace
        with self._lock:
            seen = self._seen.get(scope, 0)
            self._seen[scope] = seen + 1
            if not settings.rate or seen % settings.rate:
                return None
            if settings.count > 0:  # one fewer left; at 0 tracing stops, as Triton's count does
                if scope:
                    self.overrides[model] = {**self.overrides[model], "count": settings.count - 1}
                else:
                    self.global_settings = replace(self.global_settings, count=settings.count - 1)
                self._refresh()
        return self._start(settings.file, model, version, request_id, settings.level)

    def child(self, parent: Trace, model: str, version: int, request_id: str) -> Trace:
        return self._start(parent.scope, model, version, request_id, parent.levels, parent)

    def _start(self, scope: str, model: str, version: int, request_id: str, levels: tuple[str, ...],
               parent: Trace | None = None) -> Trace:
        """A new trace, its id the next one (itertools.count: atomic, no lock), begun now."""
        trace = Trace(self, scope, next(self._ids), model, version, request_id, parent)
        trace.levels = levels
        trace.stamps.append(("REQUEST_START", time.monotonic_ns()))
        return trace

    def hold(self, trace: Trace) -> None:
        with self._lock:
            self._held[trace.id] = trace

    def release(self, trace_id: int, start_ns: int = 0, end_ns: int = 0) -> None:
        """A held trace's front-end reported its send (between the two times; 0, 0: there was none to send):
        written now. An unknown id (reported twice, or by a confused front-end process) changes nothing."""
        with self._lock:
            trace = self._held.pop(trace_id, None)
        if trace is not None:
            if start_ns:
                names = _FRONT_STAMPS[trace.front]
                trace.stamps += [(names[2], start_ns), (names[3], end_ns)]
            self.finished(trace)

    def finished(self, trace: Trace) -> None:
        """Buffer the trace's objects; a top-level trace counts toward the file's log frequency (a step's
        trace is written with its ensemble's, before it, as Triton writes them). In the opentelemetry mode a
        top-level trace is exported as spans with its children's."""
        if self.exporter is not None:
            if trace.parent is not None:
                trace.parent.children.append(trace)
                return
            try:
                self.exporter.export(trace)
            except Exception as exc:  # noqa: BLE001 - a trace that cannot be exported costs the trace, never the request
                self.lost += 1
                log.warning("opentelemetry: trace %d not exported (%s: %s); %d lost so far", trace.id,
                            type(exc).__name__, exc, self.lost)
            return
        path = trace.scope
        with self._lock:
            self._buffers.setdefault(path, []).extend(trace.objects())
            if trace.parent_id:
                return
            self._buffered[path] = self._buffered.get(path, 0) + 1
            frequency = self._frequency(path)
            if frequency and self._buffered[path] >= frequency:
                self._write(path, f"{path}.{self._index.get(path, 0)}")
                self._index[path] = self._index.get(path, 0) + 1

    def _frequency(self, path: str) -> int:
        if self.global_settings.file == path:
            return self.global_settings.log_frequency
        return next((self.settings_for(m).log_frequency for m in self.overrides if self.settings_for(m).file == path), 0)

    def _write(self, path: str, target: str) -> None:
        """Write the buffered traces; a file that cannot be written costs those traces, never a request."""
        objects = self._buffers.pop(path, [])
        self._buffered.pop(path, None)
        if not objects:
            return
        tmp = f"{target}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(objects, f)
            os.replace(tmp, target)
        except OSError as exc:
            self.lost += len({o["id"] for o in objects})
            log.warning("trace file %s: cannot write (%s); %d trace(s) lost so far", target, exc, self.lost)

    def close(self) -> None:
        """Write what is still buffered, held traces too (their front-end never reported): to ``${file}`` when
        the log frequency is 0, else the next index; or export it (the opentelemetry mode)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for trace in held:
            self.finished(trace)
        with self._lock:
            for path in list(self._buffers):
                frequency = self._frequency(path)
                self._write(path, f"{path}.{self._index.get(path, 0)}" if frequency else path)
        if self.exporter is not None:
            self.exporter.close()  # the spans still queued are exported
