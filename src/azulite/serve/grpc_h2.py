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
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import struct
import zlib
from collections import deque
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from hpack import Decoder
from hpack.exceptions import HPACKError

from azulite.serve.grpc import InferenceServicer, _status
from azulite.serve.h2_defences import H2Defences
from azulite.serve.h2_frames import (ACK, CONTINUATION, DATA, END_HEADERS, END_STREAM, GOAWAY, HEADER_LIST_LIMIT,
                                     HEADERS, MAX_FRAME, PADDED, PING, PREFACE, PRIORITY_FLAG, PUSH_PROMISE,
                                     RECV_WINDOW, RST_STREAM, SERVICE, SETTINGS, WINDOW_UPDATE, _FRAME,
                                     _GRPC_PREFIX, _OK_TRAILERS, _RESPONSE_HEADERS, _U32, _frame, _status_block)
from azulite.serve.limits import ConnectionLimits, close_soon
from azulite.serve.proto import service_pb2 as pb

log = logging.getLogger("azulite.serve.grpc")

class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """The part of grpc.aio.ServicerContext the servicer uses."""

    __slots__ = ("metadata", "address")

    def __init__(self, metadata, address: str = "") -> None:
        self.metadata = metadata
        self.address = address

    def peer(self) -> str:
        return self.address

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise _Abort(code, details)

    def invocation_metadata(self):
        return self.metadata


def _methods(servicer: InferenceServicer) -> dict[str, tuple[Any, Any, bool]]:
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    out = {}
    for m in service.methods:
        out[SERVICE + m.name] = (getattr(pb, m.input_type.name), getattr(servicer, m.name),
                                 m.client_streaming or m.server_streaming)
    return out


class _Stream:
    __slots__ = ("sid", "path", "headers", "body", "send_window", "out", "trailers", "headers_sent",
                 "task", "queue", "encoding", "closed_remote", "recv_consumed")

    def __init__(self, sid: int, send_window: int) -> None:
        self.sid = sid
        self.path = ""
        self.headers: list = []
        self.body = bytearray()
        self.send_window = send_window
        self.out: deque[memoryview] = deque()  # DATA payload waiting for window
        self.trailers: bytes | None = None  # trailer frame bytes to write after self.out
        self.headers_sent = False
        self.task: asyncio.Task | None = None
        self.queue: asyncio.Queue | None = None  # streaming RPCs: parsed request messages
        self.encoding = b""
        self.closed_remote = False
        self.recv_consumed = 0  # DATA bytes received since this stream's last WINDOW_UPDATE


class _H2Connection(H2Defences, asyncio.Protocol):
    def __init__(self, server: "GrpcH2Server") -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.preface = False
        self.decoder = Decoder(max_header_list_size=HEADER_LIST_LIMIT)
        self.cache: dict[bytes, list] = {}
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
        self.server.connections.add(self)
        peer = transport.get_extra_info("peername")
        self.peer = f"ipv4:{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer or "")
        loop = asyncio.get_running_loop()
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
        self.streams.clear()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if not self.preface:
            if len(buf) < len(PREFACE):
                return
            if buf[:len(PREFACE)] != PREFACE:
                self._close("not an HTTP/2 gRPC client (bad connection preface)")
                return
            del buf[:len(PREFACE)]
            self.preface = True
        pos, end = 0, len(buf)
        try:
            while end - pos >= 9:
                hi, lo, ftype, flags, sid = _FRAME.unpack_from(buf, pos)
                length = (hi << 8) | lo
                if length > MAX_FRAME:
                    self._goaway(0x6, "frame larger than SETTINGS_MAX_FRAME_SIZE")
                    return
                if end - pos < 9 + length:
                    break
                payload = bytes(buf[pos + 9:pos + 9 + length])
                pos += 9 + length
                self._on_frame(ftype, flags, sid & 0x7FFFFFFF, payload)
                if self.transport is None or self.transport.is_closing():  # after a GOAWAY: no more frames
                    return
        finally:
            if pos:
                del buf[:pos]

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

    def _decode(self, block: bytes) -> list:
        cached = self.cache.get(block)
        if cached is not None:
            return cached
        table = self.decoder.header_table
        before = (len(table.dynamic_entries), table.dynamic_entries[0] if table.dynamic_entries else None,
                  table.maxsize)
        headers = self.decoder.decode(block, raw=True)
        after = (len(table.dynamic_entries), table.dynamic_entries[0] if table.dynamic_entries else None,
                 table.maxsize)
        if before[0] == after[0] and before[1] is after[1] and before[2] == after[2]:
            if len(self.cache) < 64:
                self.cache[block] = headers  # valid while the table stays as it is
        else:
            self.cache.clear()
        return headers

    def _headers_complete(self, sid: int, block: bytes, end_stream: bool) -> None:
        try:
            headers = self._decode(block)
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
        if len(self.streams) >= self.limits.max_streams:
            self.transport.write(_frame(RST_STREAM, 0, sid, _U32.pack(0x7)))  # REFUSED_STREAM: retry later
            return
        stream = _Stream(sid, self.peer_initial_window)
        self.streams[sid] = stream
        for name, value in headers:
            if name == b":path":
                stream.path = value.decode("latin-1")
            elif name == b"grpc-encoding":
                stream.encoding = value
        stream.headers = headers
        if self.going_away or self.server.stopping:
            self._finish(stream, grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
            return
        method = self.server.methods.get(stream.path)
        if method is None:
            self._finish(stream, grpc.StatusCode.UNIMPLEMENTED, f"unknown method {stream.path}")
            return
        request_type, handler, streaming = method
        if streaming:
            stream.queue = asyncio.Queue()
            stream.task = asyncio.ensure_future(self._run_streaming(stream, handler, request_type))
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

    # --- requests ----------------------------------------------------------------------------------

    def _messages(self, stream: _Stream) -> list[bytes]:
        """Complete gRPC messages at the head of the stream's body (consumed from it)."""
        body, out, pos = stream.body, [], 0
        while len(body) - pos >= 5:
            compressed, n = _GRPC_PREFIX.unpack_from(body, pos)
            if len(body) - pos - 5 < n:
                break
            message = bytes(body[pos + 5:pos + 5 + n])
            pos += 5 + n
            if compressed:
                if stream.encoding == b"gzip":
                    message = gzip.decompress(message)
                elif stream.encoding == b"deflate":
                    message = zlib.decompress(message)
                else:
                    raise _Abort(grpc.StatusCode.UNIMPLEMENTED,
                                 f"grpc-encoding {stream.encoding.decode() or 'none'} is not supported")
            out.append(message)
        if pos:
            del body[:pos]
        return out

    def _feed_messages(self, stream: _Stream) -> None:
        try:
            for message in self._messages(stream):
                stream.queue.put_nowait(message)
        except (_Abort, OSError, zlib.error) as exc:
            code, details = (exc.code, exc.details) if isinstance(exc, _Abort) else (
                grpc.StatusCode.INVALID_ARGUMENT, f"bad compressed message: {exc}")
            if stream.task is not None:
                stream.task.cancel()
            self._finish(stream, code, details)

    def _end_of_request(self, stream: _Stream) -> None:
        stream.closed_remote = True
        if stream.queue is not None:
            stream.queue.put_nowait(None)
            return
        if stream.task is not None or stream.trailers is not None:
            return
        try:
            messages = self._messages(stream)
        except _Abort as exc:
            self._finish(stream, exc.code, exc.details)
            return
        except (OSError, zlib.error) as exc:
            self._finish(stream, grpc.StatusCode.INVALID_ARGUMENT, f"bad compressed message: {exc}")
            return
        if len(messages) != 1 or stream.body:
            self._finish(stream, grpc.StatusCode.INVALID_ARGUMENT,
                         f"a unary call carries exactly one message, got {len(messages)}")
            return
        request_type, handler, _ = self.server.methods[stream.path]
        self.server.in_flight += 1
        stream.task = asyncio.ensure_future(self._run_unary(stream, handler, request_type, messages[0]))
        stream.task.add_done_callback(self._call_done)

    def _call_done(self, _task: asyncio.Task) -> None:
        # a callback, not the coroutine's finally: a task canceled before it started runs no finally
        self.server.request_done()

    async def _run_unary(self, stream: _Stream, handler, request_type, message: bytes) -> None:
        try:
            try:
                request = request_type.FromString(message)
            except DecodeError as exc:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse the request message: {exc}") from None
            response = await handler(request, _Context(stream.headers, self.peer))
            self._reply(stream, response.SerializeToString())
        except _Abort as exc:
            self._finish(stream, exc.code, exc.details)
        except asyncio.CancelledError:
            self._finish(stream, grpc.StatusCode.CANCELLED, "cancelled")
        except Exception as exc:  # noqa: BLE001
            self._finish(stream, *_status(exc))

    async def _run_streaming(self, stream: _Stream, handler, request_type) -> None:
        async def requests():
            while True:
                message = await stream.queue.get()
                if message is None:
                    return
                try:
                    yield request_type.FromString(message)
                except DecodeError as exc:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse a request message: {exc}") from None

        try:
            async for response in handler(requests(), _Context(stream.headers, self.peer)):
                self._send_message(stream, response.SerializeToString())
            self._finish(stream, grpc.StatusCode.OK, "")
        except _Abort as exc:
            self._finish(stream, exc.code, exc.details)
        except asyncio.CancelledError:
            self._finish(stream, grpc.StatusCode.CANCELLED, "cancelled")
        except Exception as exc:  # noqa: BLE001
            self._finish(stream, *_status(exc))

    # --- responses ---------------------------------------------------------------------------------

    def _headers_frame(self, sid: int, block: bytes, end_stream: bool) -> bytes:
        return _frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), sid, block)

    def _reply(self, stream: _Stream, payload: bytes) -> None:
        """A unary answer: headers, one message, OK trailers (one write when the windows allow)."""
        if self.transport is None or stream.sid not in self.streams:
            return
        data = _GRPC_PREFIX.pack(0, len(payload)) + payload
        n = len(data)
        self.control = 0  # the client's WINDOW_UPDATEs and PINGs answer our data: not a flood
        if n <= self.send_window and n <= stream.send_window and n <= self.peer_max_frame and not stream.out:
            self.send_window -= n
            del self.streams[stream.sid]
            self.completed += 1
            self.transport.write(self._headers_frame(stream.sid, _RESPONSE_HEADERS, False)
                                 + _frame(DATA, 0, stream.sid, data)
                                 + self._headers_frame(stream.sid, _OK_TRAILERS, True))
            self._maybe_close()
            return
        self._send_message(stream, payload, prefixed=data)
        self._finish(stream, grpc.StatusCode.OK, "")

    def _send_message(self, stream: _Stream, payload: bytes, prefixed: bytes | None = None) -> None:
        if self.transport is None or stream.sid not in self.streams:
            return
        self.control = 0
        if not stream.headers_sent:
            stream.headers_sent = True
            self.transport.write(self._headers_frame(stream.sid, _RESPONSE_HEADERS, False))
        stream.out.append(memoryview(prefixed if prefixed is not None else
                                     _GRPC_PREFIX.pack(0, len(payload)) + payload))
        self._flush_stream(stream)

    def _finish(self, stream: _Stream, code: grpc.StatusCode, details: str) -> None:
        """End the stream with a status: trailers after pending data, or a trailers-only answer."""
        if self.transport is None or stream.sid not in self.streams or stream.trailers is not None:
            return
        block = _OK_TRAILERS if code == grpc.StatusCode.OK else _status_block(code, details)
        if not stream.headers_sent:
            stream.headers_sent = True
            stream.trailers = self._headers_frame(stream.sid, _RESPONSE_HEADERS + block, True)
        else:
            stream.trailers = self._headers_frame(stream.sid, block, True)
        if stream.task is not None and stream.task is not asyncio.current_task() and not stream.task.done():
            stream.task.cancel()
        self._flush_stream(stream)

    def _flush_stream(self, stream: _Stream) -> None:
        """Write what the windows allow; park the stream in ``blocked`` otherwise."""
        out = stream.out
        while out:
            chunk = out[0]
            n = min(len(chunk), self.send_window, stream.send_window, self.peer_max_frame)
            if n <= 0:
                if stream not in self.blocked:
                    self.blocked.append(stream)
                self._arm_stall_timer()
                return
            self.transport.write(_frame(DATA, 0, stream.sid, bytes(chunk[:n])))
            self.send_window -= n
            stream.send_window -= n
            if n == len(chunk):
                out.popleft()
            else:
                out[0] = chunk[n:]
        if stream.trailers is not None:
            self.transport.write(stream.trailers)
            self.streams.pop(stream.sid, None)
            self.completed += 1
            self._maybe_close()

    def _pump(self) -> None:
        for _ in range(len(self.blocked)):
            stream = self.blocked.popleft()
            if stream.sid in self.streams and self.transport is not None:
                self._flush_stream(stream)

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

    def __init__(self, dataplane, guard=None, limits: ConnectionLimits | None = None) -> None:
        self.limits = limits or ConnectionLimits()
        self.servicer = InferenceServicer(dataplane)
        if guard is not None:
            from azulite.serve.grpc_guard import GuardedServicer

            self.servicer = GuardedServicer(self.servicer, guard)
        self.methods = _methods(self.servicer)
        self.connections: set[_H2Connection] = set()
        self.in_flight = 0
        self.stopping = False
        self._server: asyncio.base_events.Server | None = None
        self._idle: asyncio.Event | None = None

    def request_done(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _H2Connection(self), host, port, reuse_address=True,
                                                backlog=1024)
        return self._server.sockets[0].getsockname()[1]

    async def drain(self, timeout_s: float) -> None:
        self.stopping = True
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
