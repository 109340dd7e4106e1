"""gRPC's wire (HTTP/2, RFC 9113, + the gRPC framing) served by a bare ``asyncio.Protocol``, running the
same :class:`~azulite.serve.grpc.InferenceServicer` as the grpcio server.

Why by hand: measured with perf_analyzer at concurrency 32 on this 2-core machine, grpcio's servers are
the bottleneck of a Python gRPC endpoint (grpc.aio 3.2-3.7k RPC/s, the sync server 5.5k with an empty
handler) and pure-Python h2 costs ~360 us per request; Triton answers 5-10k. What gRPC needs of HTTP/2
is small: one request message per unary stream, one bidirectional stream for ModelStreamInfer, trailers
for the status. Headers are decoded by ``hpack`` (python-hyper) and, since clients send the same
indexed header block on every call, decoded blocks are cached while the decoder's table is unchanged.
Responses use fixed header blocks (no dynamic table). Flow control is honoured both ways; frames are
split to the peer's SETTINGS_MAX_FRAME_SIZE. Not implemented (not used by gRPC): server push, priorities.
This module is the connection protocol and the server; the calls over its streams (messages, handlers,
answers) are grpc_h2_calls.py, the hostile-client defences h2_defences.py, the framing h2_frames.py.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque

import grpc
from hpack import Decoder
from hpack.exceptions import HPACKError

from azulite.serve.grpc import InferenceServicer
from azulite.serve.grpc_h2_calls import _MODEL_INFER, H2Calls, _Stream, _methods
from azulite.serve.h2_defences import H2Defences
from azulite.serve.h2_frames import (ACK, CONTINUATION, DATA, END_HEADERS, END_STREAM, GOAWAY, HEADER_LIST_LIMIT,
                                     HEADERS, MAX_FRAME, PADDED, PING, PREFACE, PRIORITY_FLAG, PUSH_PROMISE,
                                     RECV_WINDOW, RST_STREAM, SETTINGS, WINDOW_UPDATE, _FRAME, _U32, _frame)
from azulite.serve.limits import ConnectionLimits, close_soon
from azulite.serve.otel import traceparent_of

log = logging.getLogger("azulite.serve.grpc")


#: RFC 9113 8.2.2: connection-specific fields, which an HTTP/2 request must not carry
_CONNECTION_SPECIFIC = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"})
_REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":authority", b":path"})


#: grpc-timeout's units (the gRPC over HTTP/2 spec): hours, minutes, seconds, milli-, micro-, nanoseconds
_TIMEOUT_UNITS = {ord("H"): 3600.0, ord("M"): 60.0, ord("S"): 1.0, ord("m"): 1e-3, ord("u"): 1e-6, ord("n"): 1e-9}


def _timeout_s(value: bytes) -> float | None:
    """A ``grpc-timeout`` value in seconds: at most 8 digits and a unit; None for anything else (ignored,
    as gRPC's own servers ignore a timeout they cannot read)."""
    unit = _TIMEOUT_UNITS.get(value[-1]) if value else None
    digits = value[:-1]
    if unit is None or not digits or len(digits) > 8 or not digits.isdigit():
        return None
    return int(digits) * unit


def _malformed(headers: list) -> str | None:
    """Why a request's header list is malformed (RFC 9113 8.2, 8.3), or None: an upper-case field name, a
    connection-specific field, ``te`` other than ``trailers``, a pseudo-header not of a request, repeated,
    or after a regular field. (Trailers, checked here too, carry no pseudo-headers.)"""
    regular = False
    seen: set[bytes] = set()
    for name, value in headers:
        if name[:1] == b":":
            if regular or name not in _REQUEST_PSEUDO or name in seen:
                return f"pseudo-header {name.decode('latin-1')!r} is unknown, repeated or after a regular field"
            seen.add(name)
            continue
        regular = True
        if name != name.lower():
            return f"field name {name.decode('latin-1')!r} has upper-case letters"
        if name in _CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
            return f"field {name.decode('latin-1')!r} is connection-specific"
    return None


class _H2Connection(H2Calls, H2Defences, asyncio.Protocol):
    def __init__(self, server: "GrpcH2Server") -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        # the loop, kept for the per-call work (asyncio.get_running_loop() costs a getpid() system call on 3.11)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.buf = bytearray()
        self.preface = False
        self.decoder = Decoder(max_header_list_size=HEADER_LIST_LIMIT)
        self.cache: dict[bytes, tuple[list, str, bytes]] = {}
        self.streams: dict[int, _Stream] = {}
        self.last_sid = 0
        self.send_window = 65535
        self.peer_initial_window = 65535
        self.peer_max_frame = 16384
        self.recv_consumed = 0
        self.header_block: bytearray | None = None
        self.header_sid = 0
        self.header_end_stream = False
        self.blocked: deque[_Stream] = deque()
        self.going_away = False
        self.peer = ""
        # hostile-client defences (azulite.serve.limits): counters and timers per connection
        self.limits: ConnectionLimits = server.limits
        self.settled = False  # preface and first SETTINGS received
        self.resets = 0  # streams the client cancelled
        self.completed = 0  # streams answered to the end
        self.control = 0  # control frames since the last new stream
        self.continuations = 0
        self.last_progress = 0.0
        self.stall_timer: asyncio.TimerHandle | None = None
        self.head_timer: asyncio.TimerHandle | None = None
        self.write_paused = False

    # --- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        limit = self.limits.max_connections
        if limit and len(self.server.connections) >= limit:  # a connection flood: refuse, keep the others
            transport.write(_frame(SETTINGS, 0, 0) + _frame(GOAWAY, 0, 0, _U32.pack(0) + _U32.pack(0xB)
                                                            + b"too many connections"))
            transport.close()
            self.transport = None
            return
        self.server.connections.add(self)
        peer = transport.get_extra_info("peername")
        self.peer = f"ipv4:{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer or "")
        self.loop = loop = asyncio.get_running_loop()
        self.last_progress = loop.time()
        self.head_timer = loop.call_later(self.limits.header_timeout_s, self._head_timeout)
        transport.set_write_buffer_limits(high=self.limits.max_write_buffer)
        settings = (struct.pack(">HL", 0x3, self.limits.max_streams) + struct.pack(">HL", 0x4, RECV_WINDOW)
                    + struct.pack(">HL", 0x5, MAX_FRAME) + struct.pack(">HL", 0x6, HEADER_LIST_LIMIT))
        transport.write(_frame(SETTINGS, 0, 0, settings)
                        + _frame(WINDOW_UPDATE, 0, 0, _U32.pack(RECV_WINDOW - 65535)))

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.transport = None
        for timer in (self.stall_timer, self.head_timer):
            if timer is not None:
                timer.cancel()
        for stream in self.streams.values():
            if stream.task is not None and not stream.task.done():
                stream.task.cancel()
            stream.disarm()
        self.streams.clear()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        if buf or not self.preface:
            buf += data
            src = buf
        else:  # nothing held over (the usual read: whole frames): frames are cut from the read itself,
            src = data  # one copy per payload instead of the read's append to buf and two per payload
        if not self.preface:
            if len(buf) < len(PREFACE):
                return
            if buf[:len(PREFACE)] != PREFACE:
                self._close("not an HTTP/2 gRPC client (bad connection preface)")
                return
            del buf[:len(PREFACE)]
            self.preface = True
        pos, end = 0, len(src)
        try:
            while end - pos >= 9:
                hi, lo, ftype, flags, sid = _FRAME.unpack_from(src, pos)
                length = (hi << 8) | lo
                if length > MAX_FRAME:
                    self._goaway(0x6, "frame larger than SETTINGS_MAX_FRAME_SIZE")
                    return
                if end - pos < 9 + length:
                    break
                payload = src[pos + 9:pos + 9 + length]
                if src is buf:
                    payload = bytes(payload)
                pos += 9 + length
                self._on_frame(ftype, flags, sid & 0x7FFFFFFF, payload)
                if self.transport is None or self.transport.is_closing():  # after a GOAWAY: no more frames
                    return
        finally:
            if src is buf:
                if pos:
                    del buf[:pos]
            elif pos < end:
                buf += src[pos:]  # a frame cut by the read's end: held for the next one

    # --- frames ------------------------------------------------------------------------------------

    def _on_frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self.header_block is not None and ftype != CONTINUATION:
            self._goaway(0x1, "expected CONTINUATION")
            return
        if ftype != HEADERS and ftype != CONTINUATION and (ftype != DATA or not payload and not flags & END_STREAM):
            self.control += 1  # SETTINGS, PING, WINDOW_UPDATE, PRIORITY, RST_STREAM, unknown, empty DATA
            if self.control > self.limits.max_control_frames:
                self._goaway(0xB, "too many control frames")  # ENHANCE_YOUR_CALM
                return
        if ftype == DATA:
            self._on_data(flags, sid, payload)
        elif ftype == HEADERS:
            self._on_headers(flags, sid, payload)
        elif ftype == CONTINUATION:
            if self.header_block is None or sid != self.header_sid:
                self._goaway(0x1, "unexpected CONTINUATION")
                return
            self.header_block += payload
            self.continuations += 1
            if len(self.header_block) > self.limits.max_header_bytes:
                self._goaway(0xB, "header block too large")  # ENHANCE_YOUR_CALM
                return
            if self.continuations > self.limits.max_continuations:
                self._goaway(0xB, "too many CONTINUATION frames")
                return
            if flags & END_HEADERS:
                block, self.header_block = bytes(self.header_block), None
                self._headers_complete(sid, block, self.header_end_stream)
        elif ftype == SETTINGS:
            if not flags & ACK:
                self._on_settings(payload)
                if not self.settled:
                    self.settled = True
                    if self.head_timer is not None:
                        self.head_timer.cancel()
                        self.head_timer = None
        elif ftype == WINDOW_UPDATE:
            (inc,) = _U32.unpack(payload[:4])
            inc &= 0x7FFFFFFF
            if sid == 0:
                self.send_window += inc
            elif sid in self.streams:
                self.streams[sid].send_window += inc
            if inc:
                self.last_progress = asyncio.get_running_loop().time()
            self._pump()
        elif ftype == PING:
            if not flags & ACK:
                self.transport.write(_frame(PING, ACK, 0, payload))
                self._check_write_buffer()
        elif ftype == RST_STREAM:
            stream = self.streams.pop(sid, None)
            if stream is not None:
                stream.disarm()
                self.resets += 1
                if self.resets > self.limits.reset_allowance and self.resets > self.completed:
                    self._goaway(0xB, "too many stream resets")  # rapid reset, CVE-2023-44487
                    return
                if stream.task is not None:
                    stream.task.cancel()
                if stream in self.blocked:
                    self.blocked.remove(stream)
                self._maybe_close()
        elif ftype == GOAWAY:
            self.going_away = True
            self._maybe_close()
        elif ftype == PUSH_PROMISE:
            self._goaway(0x1, "clients must not push")
        # PRIORITY and unknown frame types are ignored (RFC 9113 5.5)

    def _on_settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - 5, 6):
            key, value = struct.unpack_from(">HL", payload, i)
            if key == 0x4:
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for s in self.streams.values():
                    s.send_window += delta
            elif key == 0x5:
                self.peer_max_frame = value
        self.transport.write(_frame(SETTINGS, ACK, 0))
        self._check_write_buffer()
        self._pump()

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        pos, end = 0, len(payload)
        if flags & PADDED:
            end -= payload[0]
            pos = 1
        if flags & PRIORITY_FLAG:
            pos += 5
        block = payload[pos:end]
        end_stream = bool(flags & END_STREAM)
        if len(block) > self.limits.max_header_bytes:
            self._goaway(0xB, "header block too large")
            return
        if flags & END_HEADERS:
            self._headers_complete(sid, block, end_stream)
        else:
            self.header_block, self.header_sid, self.header_end_stream = bytearray(block), sid, end_stream
            self.continuations = 0

    def _decode(self, block: bytes) -> tuple[list, str, bytes, dict | None, str | None, float | None]:
        """The block's headers, with its ``:path``, ``grpc-encoding`` (b"" when absent), W3C trace context
        (None when absent; serve/otel.py), what makes it malformed (None: nothing) and its ``grpc-timeout``
        in seconds (None: none) picked out once per distinct block: a call whose block was seen before skips
        the scan of its headers."""
        cached = self.cache.get(block)
        if cached is not None:
            return cached
        table = self.decoder.header_table
        before = (len(table.dynamic_entries), table.dynamic_entries[0] if table.dynamic_entries else None,
                  table.maxsize)
        headers = self.decoder.decode(block, raw=True)
        after = (len(table.dynamic_entries), table.dynamic_entries[0] if table.dynamic_entries else None,
                 table.maxsize)
        path, encoding, traced, timeout = "", b"", False, None
        for name, value in headers:  # the last one counts, as a repeated header's did before
            if name == b":path":
                path = value.decode("latin-1")
            elif name == b"grpc-encoding":
                encoding = value
            elif name == b"traceparent":
                traced = True
            elif name == b"grpc-timeout":
                timeout = _timeout_s(value)
        decoded = (headers, path, encoding, traceparent_of(headers) if traced else None, _malformed(headers),
                   timeout)
        if before[0] == after[0] and before[1] is after[1] and before[2] == after[2]:
            if len(self.cache) < 64:
                self.cache[block] = decoded  # valid while the table stays as it is
        else:
            self.cache.clear()
        return decoded

    def _headers_complete(self, sid: int, block: bytes, end_stream: bool) -> None:
        try:
            headers, path, encoding, trace_context, malformed, timeout = self._decode(block)
        except HPACKError as exc:
            self._goaway(0x9, f"bad header block: {exc}")
            return
        stream = self.streams.get(sid)
        if stream is not None:  # trailers from the client: only END_STREAM matters
            if end_stream:
                self._end_of_request(stream)
            return
        if sid % 2 == 0 or sid <= self.last_sid:
            self._goaway(0x1, "bad stream id")
            return
        self.last_sid = sid
        self.control = 0
        if malformed is not None:  # RFC 9113 8.1.1: a malformed request is a stream error, PROTOCOL_ERROR
            log.info("gRPC (h2) stream %d from %s reset: %s", sid, self.peer, malformed)
            self.transport.write(_frame(RST_STREAM, 0, sid, _U32.pack(0x1)))
            return
        if len(self.streams) >= self.limits.max_streams:
            self.transport.write(_frame(RST_STREAM, 0, sid, _U32.pack(0x7)))  # REFUSED_STREAM: retry later
            return
        stream = _Stream(sid, self.peer_initial_window)
        stream.tick = self.server.tick
        self.streams[sid] = stream
        stream.path, stream.encoding, stream.headers, stream.trace_context = path, encoding, headers, trace_context
        if self.going_away or self.server.stopping:
            self._finish(stream, grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
            return
        method = self.server.methods.get(stream.path)
        if method is None:
            self._refuse_unrouted(stream, grpc.StatusCode.UNIMPLEMENTED, f"unknown method {stream.path}")
            return
        if timeout is not None:  # the client's deadline (grpc-timeout): answered DEADLINE_EXCEEDED when it passes
            stream.deadline = self.loop.call_later(timeout, self._deadline_passed, stream)
        request_type, handler, streaming, _ = method
        if streaming:
            stream.queue = asyncio.Queue()
            stream.task = asyncio.get_running_loop().create_task(self._run_streaming(stream, handler, request_type))
            self.server.in_flight += 1
            stream.task.add_done_callback(self._call_done)
        if end_stream:
            self._end_of_request(stream)

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        size = len(payload)
        if flags & PADDED:
            payload = payload[1:len(payload) - payload[0]]
        self.recv_consumed += size
        if self.recv_consumed >= RECV_WINDOW // 2:
            self.transport.write(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.recv_consumed)))
            self.recv_consumed = 0
        stream = self.streams.get(sid)
        if stream is None or stream.closed_remote:
            return
        stream.tick = self.server.tick  # progress: the sweep counts from the last bytes
        stream.body += payload
        if len(stream.body) > (1 << 16):  # big bodies only: the check sums over the streams (below: bounded
            # by max_streams x 64 KiB)
            if len(stream.body) > self.limits.max_message_bytes + 5:
                stream.body = bytearray()
                stream.closed_remote = True  # the rest of this message is dropped as it arrives
                self._finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"message larger than the server's limit of {self.limits.max_message_bytes} bytes")
                return
            if sum(len(s.body) for s in self.streams.values()) > self.limits.max_buffered_bytes:
                self._goaway(0xB, "too much request data buffered on one connection")
                return
        stream.recv_consumed += size
        if not (flags & END_STREAM) and stream.recv_consumed >= RECV_WINDOW // 2:
            # give back exactly what was received: the window never exceeds 2^31-1, and a long stream
            # (whose body is consumed message by message) keeps getting credit
            self.transport.write(_frame(WINDOW_UPDATE, 0, sid, _U32.pack(stream.recv_consumed)))
            stream.recv_consumed = 0
        if stream.queue is not None:
            self._feed_messages(stream)
        if flags & END_STREAM:
            self._end_of_request(stream)

    # --- connection --------------------------------------------------------------------------------

    def goaway(self) -> None:
        """Graceful: refuse streams after the last one seen; close once the open ones are answered."""
        if self.transport is None:
            return
        self.going_away = True
        self.transport.write(_frame(GOAWAY, 0, 0, _U32.pack(self.last_sid) + _U32.pack(0)))
        self._maybe_close()

    def _maybe_close(self) -> None:
        if self.going_away and not self.streams and self.transport is not None:
            self.transport.close()

    def _goaway(self, code: int, message: str) -> None:
        if code:
            log.info("gRPC connection from %s closed: %s", self.peer, message)
        if self.transport is not None:
            self.transport.write(_frame(GOAWAY, 0, 0, _U32.pack(self.last_sid) + _U32.pack(code) + message.encode()))
            close_soon(self.transport, self.limits)

    def _close(self, message: str) -> None:
        log.info("gRPC connection closed: %s", message)
        if self.transport is not None:
            self.transport.close()


class GrpcH2Server:
    """Same interface as :class:`azulite.serve.grpc.GrpcServer`."""

    reuse_port = False  # SO_REUSEPORT: the front-ends of a multi-worker server share the port

    def __init__(self, dataplane, guard=None, limits: ConnectionLimits | None = None) -> None:
        self.limits = limits or ConnectionLimits()
        self.servicer = self.infer_servicer = InferenceServicer(dataplane)
        if guard is not None:
            from azulite.serve.grpc_guard import GuardedServicer

            self.servicer = GuardedServicer(self.servicer, guard)
        self.methods = _methods(self.servicer)
        #: ModelInfer answered by callback (H2Calls._infer_now): the data plane's infer_then, unguarded or
        #: with the guard's (enter, leave) around it (``infer_guard``), as _run_unary runs them
        self.infer_guard = self.methods[_MODEL_INFER][3]
        if self.infer_guard is not None and guard.audit is None:  # no audit line: nothing to keep for the answer
            self.infer_guard = (self.infer_guard[0], None)
        self.infer_then = getattr(dataplane, "infer_then", None)
        #: the guard's audit log, for the calls the transport answers before any method runs
        self.audit = guard.audit if guard is not None else None
        self.connections: set[_H2Connection] = set()
        self.in_flight = 0
        self.stopping = False
        self._server: asyncio.base_events.Server | None = None
        self._idle: asyncio.Event | None = None
        self.tick = 0
        self._sweeper: asyncio.TimerHandle | None = None

    def request_done(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _H2Connection(self), host, port, reuse_address=True,
                                                reuse_port=self.reuse_port or None,
                                                backlog=1024)
        self._sweeper = loop.call_later(self.limits.header_timeout_s / 2, self._sweep)
        return self._server.sockets[0].getsockname()[1]

    def _sweep(self) -> None:
        """A unary call whose request message stopped arriving (no DATA, no END_STREAM for three ticks of
        half the header timeout: between one and 1.5 timeouts) is answered DEADLINE_EXCEEDED and forgotten:
        held open, it kept its stream and buffer for good (HTTP/1.1's body timeout, for gRPC). Streaming
        calls may sit idle by design and are left alone."""
        self.tick += 1
        for conn in list(self.connections):
            stale = [s for s in conn.streams.values() if s.queue is None and not s.closed_remote
                     and self.tick - s.tick >= 3]
            for stream in stale:
                log.info("gRPC (h2) stream %d from %s: the request stopped arriving", stream.sid, conn.peer)
                stream.closed_remote = True
                stream.body = bytearray()
                conn._finish(stream, grpc.StatusCode.DEADLINE_EXCEEDED, "the request message stopped arriving "
                             "(no byte within --header-timeout-secs)")
        self._sweeper = asyncio.get_running_loop().call_later(self.limits.header_timeout_s / 2, self._sweep)

    async def drain(self, timeout_s: float) -> None:
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.goaway()
        if self.in_flight:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                log.warning("gRPC: %d calls still in flight after %.1fs; closing", self.in_flight, timeout_s)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
