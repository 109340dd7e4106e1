"""Triton's trace extension (``GET/POST v2[/models/NAME]/trace/setting``, gRPC ``TraceSetting``) and the
traces themselves: every ``trace_rate``-th request of a model whose ``trace_level`` holds ``TIMESTAMPS``
records when it started, was queued, computed (start, input end, output start, end) and ended, and the
traces go to ``trace_file`` in Triton's JSON (``${trace_file}.${i}`` every ``log_frequency`` traces,
or ``${trace_file}`` at shutdown when it is 0), which Triton's trace tools read.

As in Triton 2.51: the file is set at start (``--trace-config triton,file=PATH``; the protocol cannot move
it: 501), ``trace_count`` counts down the traces left (-1: no limit), a model's own settings override the
global ones field by field (a ``null`` value, or an empty gRPC value list, drops the override), settings
are strings (``trace_level`` a list). Stricter than Triton, each a 400 naming the field: a rate of 0, a
log frequency below 0, a value of the wrong type or an unknown level; ``TENSORS`` and the
``opentelemetry`` mode answer 501 (not built here).

What a trace holds here: the data plane's timestamps (``REQUEST_START``, ``QUEUE_START``,
``COMPUTE_START``, ``COMPUTE_INPUT_END``, ``COMPUTE_OUTPUT_START``, ``COMPUTE_END``, ``REQUEST_END``), one
clock (CLOCK_MONOTONIC, as Triton's); a decoupled model's stream ends at its final response. Not the
front-end's HTTP/gRPC receive and send times; an ensemble's steps are not traced as its children (the
ensemble's own request is), and a BLS call a Python model makes is sampled as a request of its own. The
data plane holds the tracer, so with ``--workers`` every front-end's settings call reaches the one
tracer in the model host.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from azulite.errors import InvalidArgument, NotFound, SpecError, Unsupported

log = logging.getLogger("azulite.serve.trace")
LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
#: protocol name -> (TraceSettings field, parser)
_FIELDS = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count", "log_frequency": "log_frequency",
           "trace_file": "file", "trace_mode": "mode"}


@dataclass(frozen=True)
class TraceSettings:
    level: tuple[str, ...] = ("OFF",)
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    file: str = ""
    mode: str = "triton"

    @property
    def on(self) -> bool:
        return "TIMESTAMPS" in self.level and self.count != 0

    def as_json(self) -> dict[str, Any]:
        """As Triton answers them: strings, the level a list."""
        return {"trace_level": list(self.level), "trace_rate": str(self.rate), "trace_count": str(self.count),
                "log_frequency": str(self.log_frequency), "trace_file": self.file, "trace_mode": self.mode}


def _int(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"trace setting '{name}' must be a string holding an integer, got {json.dumps(value)}")
    try:
        number = int(value)
    except ValueError:
        raise InvalidArgument(f"Unable to parse '{name}', got: {value}") from None  # Triton's words
    if number < least:
        raise InvalidArgument(f"Unable to parse '{name}'. Expecting value >= {least}, got: {number}")
    return number


def _value(name: str, value: Any) -> Any:
    """One setting from a client, checked: the TraceSettings field's value."""
    if name == "trace_level":
        levels = [value] if isinstance(value, str) else value
        if not isinstance(levels, list) or not levels or not all(isinstance(v, str) for v in levels):
            raise InvalidArgument(f"trace setting 'trace_level' must be a list of levels ({', '.join(LEVELS)}), "
                                  f"got {json.dumps(value)}", fix='e.g. {"trace_level": ["TIMESTAMPS"]}')
        unknown = [v for v in levels if v not in LEVELS]
        if unknown:
            raise InvalidArgument(f"trace setting 'trace_level': unknown level(s) {unknown}; the levels are "
                                  f"{', '.join(LEVELS)}")
        if "TENSORS" in levels:
            raise Unsupported("trace level TENSORS is not supported by azulite", fix="trace TIMESTAMPS")
        chosen = tuple(dict.fromkeys(v for v in levels if v != "OFF")) or ("OFF",)
        return chosen
    if name == "trace_rate":
        return _int(name, value, 1)
    if name == "trace_count":
        return _int(name, value, -1)
    if name == "log_frequency":
        return _int(name, value, 0)
    if name == "trace_mode":
        if value != "triton":
            raise Unsupported(f"trace mode {json.dumps(value)} is not supported by azulite (only 'triton')")
        return value
    raise AssertionError(name)


def parse_trace_config(items: list[str] | tuple[str, ...]) -> TraceSettings:
    """Triton's ``--trace-config`` flags: ``[triton,]file=PATH``, ``[triton,]log-frequency=N``, ``rate=N``,
    ``level=OFF|TIMESTAMPS`` (repeatable), ``count=N``, ``mode=triton``."""
    fields: dict[str, Any] = {}
    levels: list[str] = []
    for item in items:
        mode, _, setting = item.partition(",") if "," in item else ("", "", item)
        key, eq, raw = setting.partition("=")
        if not eq or mode not in ("", "triton", "opentelemetry"):
            raise SpecError(f"'{item}' is not [MODE,]SETTING=VALUE", field="--trace-config",
                            fix="e.g. --trace-config triton,file=/tmp/trace.json --trace-config level=TIMESTAMPS")
        if mode == "opentelemetry":
            raise SpecError("the opentelemetry trace mode is not supported by azulite", field="--trace-config")
        try:
            if key == "file":
                fields["file"] = raw
            elif key == "log-frequency":
                fields["log_frequency"] = _value("log_frequency", raw)
            elif key == "rate":
                fields["rate"] = _value("trace_rate", raw)
            elif key == "count":
                fields["count"] = _value("trace_count", raw)
            elif key == "level":
                levels.append(raw)
            elif key == "mode":
                fields["mode"] = _value("trace_mode", raw)
            else:
                raise SpecError(f"unknown setting '{key}'", field="--trace-config",
                                fix="settings: file, log-frequency, rate, level, count, mode")
            if levels:
                fields["level"] = _value("trace_level", levels)
        except (InvalidArgument, Unsupported) as exc:
            raise SpecError(exc.message, field="--trace-config") from None
    settings = TraceSettings(**fields)
    if settings.on and not settings.file:
        raise SpecError("level=TIMESTAMPS needs a trace file", field="--trace-config",
                        fix="add --trace-config triton,file=/tmp/trace.json")
    if settings.file and not os.path.isdir(os.path.dirname(os.path.abspath(settings.file))):
        raise SpecError(f"the trace file's folder {os.path.dirname(os.path.abspath(settings.file))} does not exist",
                        field="--trace-config", fix="create it, or name a file in an existing folder")
    return settings


class Trace:
    """One traced request: its header and timestamps, in the order they were taken."""

    __slots__ = ("tracer", "scope", "id", "model", "version", "request_id", "stamps")

    def __init__(self, tracer: Tracer, scope: str, trace_id: int, model: str, version: int, request_id: str) -> None:
        self.tracer, self.scope, self.id = tracer, scope, trace_id
        self.model, self.version, self.request_id = model, version, request_id
        self.stamps: list[tuple[str, int]] = []

    def computed(self, queued_ns: int, start_ns: int, input_ns: int, output_ns: int, end_ns: int) -> None:
        self.stamps += [("QUEUE_START", queued_ns), ("COMPUTE_START", start_ns),
                        ("COMPUTE_INPUT_END", min(start_ns + input_ns, end_ns)),
                        ("COMPUTE_OUTPUT_START", max(end_ns - output_ns, start_ns + input_ns)), ("COMPUTE_END", end_ns)]

    def ended(self) -> None:
        self.stamps.append(("REQUEST_END", time.monotonic_ns()))
        self.tracer.finished(self)

    def objects(self) -> list[dict[str, Any]]:
        head = {"id": self.id, "model_name": self.model, "model_version": self.version, "request_id": self.request_id}
        return [head, *({"id": self.id, "timestamps": [{"name": name, "ns": ns}]} for name, ns in self.stamps)]


class Tracer:
    """The server's trace settings (global and per model) and the traces being written."""

    def __init__(self, settings: TraceSettings | None = None, *, known_model=lambda name: True) -> None:
        self.global_settings = settings or TraceSettings()
        self.overrides: dict[str, dict[str, Any]] = {}  # model -> its own fields
        self.known_model = known_model
        self.active = False  # any scope traces: the data plane's one check per request
        self._effective: dict[str, TraceSettings] = {}
        self._seen: dict[str, int] = {}  # requests per scope ("" global, else the model)
        self._next_id = 1
        self._buffers: dict[str, list[dict]] = {}  # trace file -> traces' objects not yet written
        self._buffered: dict[str, int] = {}  # trace file -> traces in its buffer
        self._index: dict[str, int] = {}  # trace file -> next ${file}.${i}
        self._lock = threading.Lock()  # ended() may run on an instance's thread
        self.lost = 0  # traces a failed write of the trace file lost
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
            for name, value in changes.items():
                if name not in _FIELDS:
                    raise InvalidArgument(f"unknown trace setting '{name}'; the settings are {', '.join(_FIELDS)}")
                if name == "trace_file":
                    if value != self.settings_for(model).file:
                        raise Unsupported("trace file location can not be updated through network protocol",
                                          fix="start the server with --trace-config triton,file=PATH")
                    continue
                if value is None:
                    if not model:
                        raise InvalidArgument(f"trace setting '{name}': a global setting cannot be cleared "
                                              "(a model's can: its global value then holds)")
                    cleared.append(_FIELDS[name])
                    continue
                fields[_FIELDS[name]] = _value(name, value)
            with self._lock:
                if model:
                    own = {k: v for k, v in self.overrides.get(model, {}).items() if k not in cleared}
                    own.update(fields)
                    candidate = replace(self.global_settings, **own)
                else:
                    candidate = replace(self.global_settings, **fields)
                if candidate.on and not candidate.file:  # Triton's words
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

    def sample(self, model: str, version: int, request_id: str) -> Trace | None:
        """The request's trace when it is one the settings sample, else None."""
        settings = self.settings_for(model)
        if not settings.on:
            return None
        scope = model if model in self.overrides else ""
        with self._lock:
            seen = self._seen.get(scope, 0)
            self._seen[scope] = seen + 1
            if seen % settings.rate:
                return None
            if settings.count > 0:  # one fewer left; at 0 tracing stops, as Triton's count does
                if scope:
                    self.overrides[model] = {**self.overrides[model], "count": settings.count - 1}
                else:
                    self.global_settings = replace(self.global_settings, count=settings.count - 1)
                self._refresh()
            trace = Trace(self, settings.file, self._next_id, model, version, request_id)
            self._next_id += 1
        trace.stamps.append(("REQUEST_START", time.monotonic_ns()))
        return trace

    def finished(self, trace: Trace) -> None:
        path = trace.scope
        with self._lock:
            self._buffers.setdefault(path, []).extend(trace.objects())
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
        """Write what is still buffered: to ``${file}`` when the log frequency is 0, else the next index."""
        with self._lock:
            for path in list(self._buffers):
                frequency = self._frequency(path)
                self._write(path, f"{path}.{self._index.get(path, 0)}" if frequency else path)
