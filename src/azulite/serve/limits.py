"""What one connection may cost the server, for both hand-written transports (HTTP/1.1 in http.py,
HTTP/2 for gRPC in grpc_h2.py): the defences against slow, flooding and hostile clients.

Each limit names the attack it answers. Passing one closes the offending connection (HTTP/2: GOAWAY
with ENHANCE_YOUR_CALM or the protocol's error code first); every other connection is untouched. The
defaults leave any well-behaved client (tritonclient, perf_analyzer, grpcio) far below them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLimits:
    #: slowloris: a request's head (HTTP/1.1 request line + headers; HTTP/2 connection preface and first
    #: SETTINGS) must arrive within this many seconds of its first byte / of the connection
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


def close_soon(transport, limits: ConnectionLimits) -> None:
    """Close after what is queued is written; if the client does not read it within stall_timeout_s,
    abort (a plain close() would hold the connection and its buffer for as long as the client waits)."""
    transport.close()
    if transport.get_write_buffer_size():
        import asyncio

        asyncio.get_running_loop().call_later(limits.stall_timeout_s, transport.abort)
