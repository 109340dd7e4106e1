"""Triton's trace settings (serve/trace.py's): what ``--trace-config`` and the trace extension's
``GET/POST v2[/models/NAME]/trace/setting`` / gRPC ``TraceSetting`` take, checked.

As in Triton 2.51: the file is set at start (``--trace-config triton,file=PATH``; the protocol cannot move
it: 501), ``trace_count`` counts down the traces left (-1: no limit), a rate of 0 samples no request (in
the opentelemetry mode only those that carry a trace context are traced), a model's own settings override
the global ones field by field (a ``null`` value, or an empty gRPC value list, drops the override),
settings are strings (``trace_level`` a list). The mode (``triton``: the trace file; ``opentelemetry``:
spans over OTLP/HTTP, serve/otel.py) and the exporter's settings are chosen at start. Stricter than
Triton, each a 400 naming the field: a log frequency below 0, a value of the wrong type, an unknown level,
a setting of the other mode.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from azulite.errors import InvalidArgument, SpecError, Unsupported
from azulite.serve.otel import OtelSettings

LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
#: protocol name -> TraceSettings field
FIELDS = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count", "log_frequency": "log_frequency",
          "trace_file": "file", "trace_mode": "mode"}
#: the opentelemetry mode's settings (fixed at start) -> their value as the protocol shows it
OTEL_FIELDS = {"url": lambda o: o.url, "bsp_schedule_delay": lambda o: str(o.bsp_schedule_delay),
               "bsp_max_export_batch_size": lambda o: str(o.bsp_max_export_batch_size),
               "bsp_max_queue_size": lambda o: str(o.bsp_max_queue_size)}


@dataclass(frozen=True)
class TraceSettings:
    level: tuple[str, ...] = ("OFF",)
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    file: str = ""
    mode: str = "triton"  # or "opentelemetry" (serve/otel.py)
    otel: OtelSettings = OtelSettings()

    @property
    def on(self) -> bool:
        return ("TIMESTAMPS" in self.level or "TENSORS" in self.level) and self.count != 0

    def as_json(self) -> dict[str, Any]:
        """As Triton answers them: strings, the level a list; each mode's own settings."""
        common = {"trace_level": list(self.level), "trace_rate": str(self.rate), "trace_count": str(self.count),
                  "trace_mode": self.mode}
        if self.mode == "opentelemetry":
            return {**common, **self.otel.as_json()}
        return {**common, "log_frequency": str(self.log_frequency), "trace_file": self.file}


def int_setting(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"trace setting '{name}' must be a string holding an integer, got {json.dumps(value)}")
    try:
        number = int(value)
    except ValueError:
        raise InvalidArgument(f"Unable to parse '{name}', got: {value}") from None  # Triton's words
    if number < least:
        raise InvalidArgument(f"Unable to parse '{name}'. Expecting value >= {least}, got: {number}")
    return number


def setting_value(name: str, value: Any) -> Any:
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
        chosen = tuple(dict.fromkeys(v for v in levels if v != "OFF")) or ("OFF",)
        return chosen
    if name == "trace_rate":
        return int_setting(name, value, 0)
    if name == "trace_count":
        return int_setting(name, value, -1)
    if name == "log_frequency":
        return int_setting(name, value, 0)
    if name == "trace_mode":
        if value not in ("triton", "opentelemetry"):
            raise InvalidArgument(f"trace setting 'trace_mode' must be \"triton\" or \"opentelemetry\", got "
                                  f"{json.dumps(value)}")
        return value
    raise AssertionError(name)


def parse_trace_config(items: list[str] | tuple[str, ...]) -> TraceSettings:
    """Triton's ``--trace-config`` flags: ``[triton,]file=PATH``, ``[triton,]log-frequency=N``, ``rate=N``,
    ``level=OFF|TIMESTAMPS`` (repeatable), ``count=N``, ``mode=triton|opentelemetry``, and the
    opentelemetry mode's ``opentelemetry,url=URL``, ``opentelemetry,resource=KEY=VALUE`` (repeatable),
    ``opentelemetry,bsp_max_queue_size=N``, ``opentelemetry,bsp_schedule_delay=MS``,
    ``opentelemetry,bsp_max_export_batch_size=N``."""
    fields: dict[str, Any] = {}
    otel: dict[str, Any] = {}
    levels: list[str] = []
    resource: list[tuple[str, str]] = []
    for item in items:
        mode, _, setting = item.partition(",") if "," in item else ("", "", item)
        key, eq, raw = setting.partition("=")
        if not eq or mode not in ("", "triton", "opentelemetry"):
            raise SpecError(f"'{item}' is not [MODE,]SETTING=VALUE", field="--trace-config",
                            fix="e.g. --trace-config triton,file=/tmp/trace.json --trace-config level=TIMESTAMPS")
        try:
            if mode == "opentelemetry":
                if key == "url":
                    otel["url"] = raw
                elif key == "resource":
                    name, eq, value = raw.partition("=")
                    if not eq or not name:
                        raise SpecError(f"'{raw}' is not KEY=VALUE", field="--trace-config opentelemetry,resource",
                                        fix="e.g. --trace-config opentelemetry,resource=service.name=my-server")
                    resource.append((name, value))
                elif key in ("bsp_max_queue_size", "bsp_schedule_delay", "bsp_max_export_batch_size"):
                    otel[key] = int_setting(key, raw, 1)
                else:
                    raise SpecError(f"unknown opentelemetry setting '{key}'", field="--trace-config",
                                    fix="opentelemetry settings: url, resource, bsp_max_queue_size, "
                                        "bsp_schedule_delay, bsp_max_export_batch_size")
            elif key == "file":
                fields["file"] = raw
            elif key == "log-frequency":
                fields["log_frequency"] = setting_value("log_frequency", raw)
            elif key == "rate":
                fields["rate"] = setting_value("trace_rate", raw)
            elif key == "count":
                fields["count"] = setting_value("trace_count", raw)
            elif key == "level":
                levels.append(raw)
            elif key == "mode":
                fields["mode"] = setting_value("trace_mode", raw)
            else:
                raise SpecError(f"unknown setting '{key}'", field="--trace-config",
                                fix="settings: file, log-frequency, rate, level, count, mode")
            if levels:
                fields["level"] = setting_value("trace_level", levels)
        except (InvalidArgument, Unsupported) as exc:
            raise SpecError(exc.message, field="--trace-config") from None
    if resource:
        otel["resource"] = tuple(resource)
    settings = TraceSettings(**fields, otel=OtelSettings(**otel))
    if settings.mode == "opentelemetry":
        if settings.file or "log_frequency" in fields:
            raise SpecError("the trace file and its log frequency are the triton mode's; the opentelemetry mode "
                            "exports spans to its url", field="--trace-config",
                            fix="drop triton,file=/triton,log-frequency=, or drop mode=opentelemetry")
        if settings.otel.bsp_max_export_batch_size > settings.otel.bsp_max_queue_size:
            raise SpecError(f"bsp_max_export_batch_size ({settings.otel.bsp_max_export_batch_size}) must not exceed "
                            f"bsp_max_queue_size ({settings.otel.bsp_max_queue_size})", field="--trace-config")
        return settings
    if otel:
        raise SpecError("opentelemetry settings need the opentelemetry mode", field="--trace-config",
                        fix="add --trace-config mode=opentelemetry")
    if settings.on and not settings.file:
        raise SpecError("level=TIMESTAMPS needs a trace file", field="--trace-config",
                        fix="add --trace-config triton,file=/tmp/trace.json, or --trace-config mode=opentelemetry")
    if settings.file and not os.path.isdir(os.path.dirname(os.path.abspath(settings.file))):
        raise SpecError(f"the trace file's folder {os.path.dirname(os.path.abspath(settings.file))} does not exist",
                        field="--trace-config", fix="create it, or name a file in an existing folder")
    return settings
