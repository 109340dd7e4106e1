"""What one connection may cost the server, for both hand-written transports (HTTP/1.1 in http.py,
HTTP/2 for gRPC in grpc_h2.py): the defences against slow, flooding and hostile clients.

Each limit names the attack it answers. Passing one closes the offending connection (HTTP/2: GOAWAY
with ENHANCE_YOUR_CALM or the protocol's error code first); every other connection is untouched. The
defaults leave any well-behaved client (tritonclient, perf_analyzer, grpcio) far below them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from azulite.errors import SpecError


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLimits:
    #: connection floods: open connections per listener (HTTP and gRPC each) past which a new one is
    #: answered 503 (HTTP/1.1, when no keep-alive connection is idle to close instead) / GOAWAY (HTTP/2)
    #: and closed; 0: no limit (Triton has none)
    max_connections: int = 0
    #: slowloris: a request's head (HTTP/1.1 request line + headers; HTTP/2 connection preface and first
    #: SETTINGS) must arrive within this many seconds of its first byte / of the connection, and an
    #: HTTP/1.1 body may not pause longer
    header_timeout_s: float = 30.0
    #: a request head larger than this (bytes) answers 431 and closes (HTTP/1.1); HTTP/2 header blocks
    #: (compressed, CONTINUATION included) past it close the connection
    max_header_bytes: int = 64 * 1024
    #: HTTP/2 CONTINUATION flood (CVE-2024-27316 family): frames in one header block
    max_continuations: int = 32
    #: HTTP/1.1 pipelining: requests read ahead of their answers before reading pauses
    max_pipelined: int = 64
    #: HTTP/2: SETTINGS_MAX_CONCURRENT_STREAMS advertised and enforced (streams past it are refused)
    max_streams: int = 1024
    #: HTTP/2 rapid reset (CVE-2023-44487): streams the client may cancel beyond those it let finish
    reset_allowance: int = 200
    #: HTTP/2 SETTINGS / PING / WINDOW_UPDATE / PRIORITY / empty-frame floods: control frames allowed
    #: between two new streams
    max_control_frames: int = 10_000
    #: zero-window stalls: an answer blocked by flow control with no WINDOW_UPDATE for this long closes
    #: the connection (its buffered answers are freed)
    stall_timeout_s: float = 30.0
    #: answers queued for a client that does not read (bytes in the socket's write buffer) before the
    #: connection stops reading (HTTP/1.1) or is closed (HTTP/2 control-frame answers)
    max_write_buffer: int = 8 * 1024 * 1024
    #: gRPC: request bytes buffered per connection (all streams); one message past max_message_bytes
    #: answers RESOURCE_EXHAUSTED, the connection past max_buffered_bytes closes
    max_message_bytes: int = 64 * 1024 * 1024
    max_buffered_bytes: int = 256 * 1024 * 1024


#: field -> the ``azulite serve`` flag that sets it (its help is the field's comment above, in short)
FLAGS: dict[str, str] = {
    "max_connections": "--max-connections",
    "header_timeout_s": "--header-timeout-secs",
    "max_header_bytes": "--max-header-bytes",
    "max_continuations": "--max-continuation-frames",
    "max_pipelined": "--max-pipelined-requests",
    "max_streams": "--max-concurrent-streams",
    "reset_allowance": "--rapid-reset-allowance",
    "max_control_frames": "--max-control-frames",
    "stall_timeout_s": "--stall-timeout-secs",
    "max_write_buffer": "--max-write-buffer-bytes",
    "max_message_bytes": "--grpc-max-message-bytes",
    "max_buffered_bytes": "--grpc-max-buffered-bytes",
}
#: limits only azulite's HTTP/2 transport has: with ``--grpc-impl grpcio`` (grpc.aio has no such option)
#: they would do nothing, so giving one is an error. grpc.aio honours max_header_bytes, max_streams and
#: max_message_bytes (as its channel options); the rest concern the HTTP/1.1 transport too.
H2_ONLY = frozenset({"max_continuations", "reset_allowance", "max_control_frames", "max_buffered_bytes"})
#: below these a well-behaved client (tritonclient, perf_analyzer, grpcio) is itself refused
_FLOORS = {"max_header_bytes": 4096, "max_streams": 1, "max_continuations": 1, "max_pipelined": 1,
           "max_control_frames": 10, "max_write_buffer": 64 * 1024, "max_message_bytes": 1024,
           "max_buffered_bytes": 1024, "reset_allowance": 0, "max_connections": 0}


def limits_from_flags(values: dict[str, float | int | None], *, grpc_impl: str = "h2") -> ConnectionLimits:
    """``values``: field -> the flag's value (None: not given, the default stays). A value out of range
    raises a SpecError naming the flag and the accepted range."""
    given = {k: v for k, v in values.items() if v is not None}
    defaults = ConnectionLimits()
    for name, value in given.items():
        flag = FLAGS[name]
        kind = type(getattr(defaults, name))
        if kind is float:
            if not value > 0 or value != value or value == float("inf"):
                raise SpecError(f"must be a positive number of seconds, got {value}", field=flag,
                                fix=f"e.g. {flag} {getattr(defaults, name):g}")
        else:
            floor = _FLOORS.get(name, 1)
            if int(value) != value or value < floor:
                raise SpecError(f"must be a whole number of at least {floor}, got {value}", field=flag,
                                fix=f"e.g. {flag} {getattr(defaults, name) or 1000}")
    limits = replace(defaults, **{k: (float(v) if type(getattr(defaults, k)) is float else int(v))
                                  for k, v in given.items()})
    if limits.max_message_bytes > limits.max_buffered_bytes:
        raise SpecError(f"{limits.max_message_bytes} is larger than --grpc-max-buffered-bytes "
                        f"{limits.max_buffered_bytes} (one message must fit in what a connection may buffer)",
                        field="--grpc-max-message-bytes",
                        fix="lower it, or raise --grpc-max-buffered-bytes")
    if grpc_impl == "grpcio":
        ignored = sorted(FLAGS[k] for k in given if k in H2_ONLY)
        if ignored:
            raise SpecError(f"--grpc-impl grpcio cannot enforce {', '.join(ignored)} (grpc.aio's server has no "
                            "such option)", field=ignored[0], fix="use --grpc-impl h2 (the default), or drop it")
    return limits


assert set(FLAGS) == {f.name for f in fields(ConnectionLimits)}


def close_soon(transport, limits: ConnectionLimits) -> None:
    """Close after what is queued is written; if the client does not read it within stall_timeout_s,
    abort (a plain close() would hold the connection and its buffer for as long as the client waits)."""
    transport.close()
    if transport.get_write_buffer_size():
        import asyncio

        asyncio.get_running_loop().call_later(limits.stall_timeout_s, transport.abort)
