"""The gRPC calls carried by azulite's HTTP/2 transport (grpc_h2.py): a stream's state, the request
messages cut from its DATA (length prefix, gzip/deflate), the servicer run for unary and streaming methods,
and the answers written back under the peer's flow-control windows (headers, messages, trailers with the
status). Mixed into the connection class, as h2_defences is, so that grpc_h2.py reads as the HTTP/2
connection protocol (frames, SETTINGS, HEADERS/DATA intake, GOAWAY) and this as gRPC over its streams.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from functools import partial
from time import monotonic_ns
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from azulite.errors import InvalidArgument, PayloadTooLarge
from azulite.serve.grpc import InferenceServicer, _status, _trailers, decode_infer_request, encode_infer_response
from azulite.serve.h2_frames import (DATA, END_HEADERS, END_STREAM, HEADERS, SERVICE, _GRPC_PREFIX, _OK_TRAILERS,
                                     _RESPONSE_HEADERS, _frame, _status_block)
from azulite.serve.inflate import inflate
from azulite.serve.proto import service_pb2 as pb


#: a unary answer's bytes before its message (HEADERS frame with the response headers, DATA frame header,
#: gRPC length prefix) and after it (the OK trailers' HEADERS frame), each packed by one struct in one
#: call: the same bytes as three _frame calls, without the calls and the copies of their concatenation
_UNARY_HEAD = struct.Struct(">HBBBL%dsHBBBLBL" % len(_RESPONSE_HEADERS))
_UNARY_TAIL = struct.Struct(">HBBBL%ds" % len(_OK_TRAILERS))
#: the path answered by callback when the server allows it (H2Calls._infer_now)
_MODEL_INFER = SERVICE + "ModelInfer"


def _unary_answer(sid: int, payload: bytes) -> bytes:
    n, h, t = len(payload) + 5, len(_RESPONSE_HEADERS), len(_OK_TRAILERS)
    return b"%s%s%s" % (
        _UNARY_HEAD.pack(h >> 8, h & 0xFF, HEADERS, END_HEADERS, sid, _RESPONSE_HEADERS,
                         n >> 8, n & 0xFF, DATA, 0, sid, 0, len(payload)),
        payload,
        _UNARY_TAIL.pack(t >> 8, t & 0xFF, HEADERS, END_HEADERS | END_STREAM, sid, _OK_TRAILERS))


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata=()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing_metadata = code, details, tuple(trailing_metadata or ())


class _Context:
    """The part of grpc.aio.ServicerContext the servicer uses."""

    __slots__ = ("metadata", "address", "request_bytes", "reply_payload", "recv_start", "recv_end", "trace",
                 "trace_context")
    #: the guard's audit reads a unary call's sizes here instead of asking protobuf (ByteSize serializes)
    sizes_known = True

    def __init__(self, metadata, address: str = "", request_bytes: int | None = None,
                 stream: _Stream | None = None) -> None:
        self.metadata = metadata
        self.address = address
        self.request_bytes = request_bytes  # the request message's length (unary calls)
        self.reply_payload: bytes | None = None  # the answer, when the guard serialized it for its audit line
        # a unary call's receive times (its headers, its request's end) for a trace, and the traced answer's
        # trace the servicer hands back for its send (serve/trace.py)
        self.recv_start, self.recv_end = (0, 0) if stream is None else (stream.recv_start, stream.recv_end)
        self.trace = None
        self.trace_context = None if stream is None else stream.trace_context  # its W3C trace context (otel.py)

    def peer(self) -> str:
        return self.address

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise _Abort(code, details, trailing_metadata)

    def invocation_metadata(self):
        return self.metadata


def _methods(servicer: InferenceServicer) -> dict[str, tuple[Any, Any, bool, tuple | None]]:
    """path -> (request type, handler, streaming, guard): ``guard`` is a guarded servicer's (enter, leave)
    for a unary RPC whose check and audit this transport runs in its own call around the real method
    (grpc_guard.py ``unary_parts``); None: the handler is all there is to call."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    folded = getattr(servicer, "folded", {})
    out = {}
    for m in service.methods:
        handler, guard = getattr(servicer, m.name), None
        if m.name in folded:
            handler, *guard = folded[m.name]
            guard = tuple(guard)
        out[SERVICE + m.name] = (getattr(pb, m.input_type.name), handler, m.client_streaming or m.server_streaming,
                                 guard)
    return out


class _Stream:
    __slots__ = ("sid", "path", "headers", "body", "send_window", "out", "trailers", "headers_sent",
                 "task", "queue", "encoding", "closed_remote", "recv_consumed", "recv_start", "recv_end",
                 "trace_context", "tick", "deadline")

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
        self.tick = 0  # the server's sweep tick of its last request bytes (a unary request that stops is cut off)
        # when its headers came and its request ended: a traced call's GRPC_WAITREAD_START/END
        self.recv_start = monotonic_ns()
        self.recv_end = 0
        self.trace_context: dict[str, str] | None = None  # the call's W3C trace context (serve/otel.py)
        self.deadline: asyncio.TimerHandle | None = None  # the client's grpc-timeout, when it sent one

    def disarm(self) -> None:
        """Its grpc-timeout no longer matters: the call was answered or reset, or the connection is gone."""
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None


class H2Calls:
    """Needs of the connection: ``transport``, ``loop``, ``server``, ``streams``, ``peer``, ``send_window``,
    ``peer_max_frame``, ``blocked``, ``control``, ``completed``, ``_maybe_close`` and ``_arm_stall_timer``."""

    __slots__ = ()

    # --- requests ----------------------------------------------------------------------------------

    def _messages(self, stream: _Stream) -> list[bytes]:
        """Complete gRPC messages at the head of the stream's body (consumed from it)."""
        body, out, pos = stream.body, [], 0
        while len(body) - pos >= 5:
            compressed, n = _GRPC_PREFIX.unpack_from(body, pos)
            if n > self.limits.max_message_bytes:  # said by its prefix: refused whole, however small the body
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"message of {n} bytes is larger than the "
                             f"server's limit of {self.limits.max_message_bytes} bytes (--grpc-max-message-bytes)")
            if len(body) - pos - 5 < n:
                break
            message = bytes(body[pos + 5:pos + 5 + n])
            pos += 5 + n
            if compressed:
                if stream.encoding not in (b"gzip", b"deflate"):
                    raise _Abort(grpc.StatusCode.UNIMPLEMENTED,
                                 f"grpc-encoding {stream.encoding.decode() or 'none'} is not supported")
                try:  # the message limit holds for what it inflates to (a few KiB can inflate to GiB)
                    message = inflate(message, stream.encoding, self.limits.max_message_bytes, what="message",
                                      flag="--grpc-max-message-bytes")
                except PayloadTooLarge as exc:
                    raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message) from None
                except InvalidArgument as exc:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad compressed message: {exc.message}") from None
            out.append(message)
        if pos:
            del body[:pos]
        return out

    def _feed_messages(self, stream: _Stream) -> None:
        try:
            for message in self._messages(stream):
                stream.queue.put_nowait(message)
        except _Abort as exc:
            if stream.task is not None:
                stream.task.cancel()
            self._finish(stream, exc.code, exc.details)

    def _refuse_unrouted(self, stream: _Stream, code: grpc.StatusCode, details: str) -> None:
        """A call answered by the transport before any method ran (an unknown method, a message that does
        not parse or is too large, not exactly one message): answered, and on a guarded server with an
        audit log given its line (the guard audits the calls it sees; these it never saw)."""
        self._finish(stream, code, details)
        audit = self.server.audit
        if audit is not None:
            audit.record(None, None, self.peer, "", "", "grpc", code.name,
                         (monotonic_ns() - stream.recv_start) / 1e9, len(stream.body), 0)

    def _end_of_request(self, stream: _Stream) -> None:
        stream.closed_remote = True
        stream.recv_end = monotonic_ns()
        if stream.queue is not None:
            stream.queue.put_nowait(None)
            return
        if stream.task is not None or stream.trailers is not None:
            return
        try:
            messages = self._messages(stream)
        except _Abort as exc:
            self._refuse_unrouted(stream, exc.code, exc.details)
            return
        if len(messages) != 1 or stream.body:
            self._refuse_unrouted(stream, grpc.StatusCode.INVALID_ARGUMENT,
                                  f"a unary call carries exactly one message, got {len(messages)}")
            return
        request_type, handler, _, guard = self.server.methods[stream.path]
        self.server.in_flight += 1
        if stream.path == _MODEL_INFER and self.server.infer_then is not None:
            # one loop pass later, where the call's Task would have begun (see HttpApp._infer_now)
            self.loop.call_soon(self._infer_now, stream, messages[0])
            return
        # the loop's create_task, not ensure_future: two Python frames and type checks less per call
        stream.task = self.loop.create_task(self._run_unary(stream, handler, request_type, messages[0], guard))
        stream.task.add_done_callback(self._call_done)

    def _infer_now(self, stream: _Stream, message: bytes) -> None:
        """ModelInfer without a Task or coroutine: the data plane's ``infer_then`` answers it by callback
        (:meth:`_infer_answered`), and its batcher's future stands as the stream's task (a RST_STREAM or a
        lost connection cancels it: the call ends CANCELLED, counted so). A guarded server's check and audit
        run around it as :meth:`_run_unary` runs them (the guard's ``enter`` before the request is decoded:
        a refusal comes before any complaint about the tensors). A model the data plane cannot answer so
        runs :meth:`_infer_decoded`'s coroutine; a message that does not parse, the servicer's own method.
        A call reset before this ran is only counted out."""
        if stream.sid not in self.streams or stream.trailers is not None:
            self.server.request_done()
            return
        try:
            message_pb = pb.ModelInferRequest.FromString(message)
        except DecodeError:
            request_type, handler, _, guard = self.server.methods[_MODEL_INFER]
            stream.task = asyncio.get_running_loop().create_task(
                self._run_unary(stream, handler, request_type, message, guard))
            stream.task.add_done_callback(self._call_done)
            return
        guard, audit = self.server.infer_guard, None
        try:
            if guard is not None:
                context = _Context(stream.headers, self.peer, len(message))
                state = guard[0](message_pb, context)  # a refusal raises, audited
                if guard[1] is not None:  # an audit line when answered (its context made then: see _answer_infer)
                    audit = (state, len(message))
            request = decode_infer_request(message_pb)
            request.front_end, request.recv_start, request.recv_end = "GRPC", stream.recv_start, stream.recv_end
            request.trace_context = stream.trace_context
        except Exception as exc:  # noqa: BLE001 - as the servicer answers it
            self._answer_infer(stream, audit, None, exc)
            self.server.request_done()
            return
        servicer = self.server.infer_servicer
        servicer.in_flight += 1
        try:
            future = self.server.infer_then(request, partial(self._infer_answered, stream, audit))
        except Exception as exc:  # noqa: BLE001
            servicer.in_flight -= 1
            self._answer_infer(stream, audit, None, exc)
            self.server.request_done()
            return
        if future is None:
            servicer.in_flight -= 1
            stream.task = asyncio.get_running_loop().create_task(self._infer_decoded(stream, request, audit))
            stream.task.add_done_callback(self._call_done)
        else:
            stream.task = future

    def _infer_answered(self, stream: _Stream, audit: tuple | None, response, error: BaseException | None) -> None:
        self.server.infer_servicer.in_flight -= 1
        try:
            self._answer_infer(stream, audit, response, error)
        finally:
            self.server.request_done()

    async def _infer_decoded(self, stream: _Stream, request, audit: tuple | None = None) -> None:
        """ModelInfer's general path after _infer_now decoded the request (as InferenceServicer.ModelInfer)."""
        servicer = self.server.infer_servicer
        servicer.in_flight += 1
        try:
            response = await servicer.dp.infer(request)
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - a cancelled call is answered CANCELLED
            self._answer_infer(stream, audit, None, exc)
        else:
            self._answer_infer(stream, audit, response, None)
        finally:
            servicer.in_flight -= 1

    def _answer_infer(self, stream: _Stream, audit: tuple | None, response, error: BaseException | None) -> None:
        """A ModelInfer's answer, or its error (CANCELLED for a cancelled one), on the stream; a guarded
        call's audit line first (``audit``: the guard's state and the request message's length). Neither the
        request message nor a context is held in flight for it (made again here): a tracked object kept per
        call from the check to the answer doubled the server's young-generation collections at c=32 (a
        tuple is not counted: it comes from and goes back to its free list)."""
        leave = context = None
        if audit is not None:
            leave, context = self.server.infer_guard[1], _Context(stream.headers, self.peer, audit[1])
        if error is None:
            try:
                answer = encode_infer_response(response)
            except Exception as exc:  # noqa: BLE001 - the answer's encoding failed
                error = exc
                if response.trace is not None:
                    response.trace.sent(0, 0)
            else:
                payload = None
                if leave is not None:  # its line serializes the answer once, for its size (reply_payload)
                    leave(audit[0], None, context, answer, None)
                    payload = context.reply_payload
                payload = payload if payload is not None else answer.SerializeToString()
                if response.trace is None:
                    self._reply(stream, payload)
                else:
                    self._traced_reply(stream, payload, response.trace)
                return
        if leave is not None:
            leave(audit[0], None, context, None, error)
        if isinstance(error, asyncio.CancelledError):
            self._finish(stream, grpc.StatusCode.CANCELLED, "cancelled")
        else:
            self._finish(stream, *_status(error), _trailers(error))

    def _call_done(self, _task: asyncio.Task) -> None:
        # a callback, not the coroutine's finally: a task canceled before it started runs no finally
        self.server.request_done()

    async def _run_unary(self, stream: _Stream, handler, request_type, message: bytes, guard=None) -> None:
        try:
            try:
                request = request_type.FromString(message)
            except DecodeError as exc:
                self._refuse_unrouted(stream, grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse the request message: {exc}")
                return
            context = _Context(stream.headers, self.peer, len(message), stream)
            if guard is None:
                response = await handler(request, context)
            else:  # the guard's check and audit here, around the real method (grpc_guard.unary_parts)
                enter, leave = guard
                state = enter(request, context)  # a refusal raises ServeError: answered below, audited
                try:
                    response = await handler(request, context)
                except BaseException as exc:
                    leave(state, request, context, None, exc)
                    raise
                leave(state, request, context, response, None)
            payload = context.reply_payload
            payload = payload if payload is not None else response.SerializeToString()
            if context.trace is None:
                self._reply(stream, payload)
            else:  # a traced ModelInfer (InferenceServicer.ModelInfer handed its trace back)
                self._traced_reply(stream, payload, context.trace)
        except _Abort as exc:
            self._finish(stream, exc.code, exc.details, exc.trailing_metadata)
        except asyncio.CancelledError:
            self._finish(stream, grpc.StatusCode.CANCELLED, "cancelled")
        except Exception as exc:  # noqa: BLE001
            self._finish(stream, *_status(exc), _trailers(exc))

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
            async for response in handler(requests(), _Context(stream.headers, self.peer, None, stream)):
                self._send_message(stream, response.SerializeToString())
            self._finish(stream, grpc.StatusCode.OK, "")
        except _Abort as exc:
            self._finish(stream, exc.code, exc.details, exc.trailing_metadata)
        except asyncio.CancelledError:
            self._finish(stream, grpc.StatusCode.CANCELLED, "cancelled")
        except Exception as exc:  # noqa: BLE001
            self._finish(stream, *_status(exc), _trailers(exc))

    # --- responses ---------------------------------------------------------------------------------

    def _headers_frame(self, sid: int, block: bytes, end_stream: bool) -> bytes:
        return _frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), sid, block)

    def _reply(self, stream: _Stream, payload: bytes) -> None:
        """A unary answer: headers, one message, OK trailers (one write when the windows allow)."""
        if self.transport is None or stream.sid not in self.streams:
            return
        n = len(payload) + 5
        self.control = 0  # the client's WINDOW_UPDATEs and PINGs answer our data: not a flood
        if n <= self.send_window and n <= stream.send_window and n <= self.peer_max_frame and not stream.out:
            self.send_window -= n
            del self.streams[stream.sid]
            stream.disarm()
            self.completed += 1
            self.transport.write(_unary_answer(stream.sid, payload))
            self._maybe_close()
            return
        self._send_message(stream, payload, prefixed=_GRPC_PREFIX.pack(0, len(payload)) + payload)
        self._finish(stream, grpc.StatusCode.OK, "")

    def _traced_reply(self, stream: _Stream, payload: bytes, trace) -> None:
        """_reply, its send reported to the trace (GRPC_SEND_START/END; serve/trace.py)."""
        if self.transport is None or stream.sid not in self.streams:
            trace.sent(0, 0)  # the call is gone: nothing sent
            return
        start = monotonic_ns()
        self._reply(stream, payload)
        trace.sent(start, monotonic_ns())

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

    def _deadline_passed(self, stream: _Stream) -> None:
        """The client's ``grpc-timeout`` ran out before its answer: DEADLINE_EXCEEDED, as a gRPC server
        answers, and the call is cancelled (a request still queued for its model then never runs)."""
        stream.deadline = None
        if self.streams.get(stream.sid) is not stream or stream.trailers is not None:
            return
        stream.closed_remote = True  # whatever more of the request arrives is not read
        stream.body = bytearray()
        self._finish(stream, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _finish(self, stream: _Stream, code: grpc.StatusCode, details: str, metadata=()) -> None:
        """End the stream with a status (and trailing ``metadata``: (key, value) pairs): trailers after
        pending data, or a trailers-only answer."""
        if self.transport is None or stream.sid not in self.streams or stream.trailers is not None:
            return
        block = _OK_TRAILERS if code == grpc.StatusCode.OK else _status_block(code, details, metadata)
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
            stream.disarm()
            self.completed += 1
            self._maybe_close()

    def _pump(self) -> None:
        for _ in range(len(self.blocked)):
            stream = self.blocked.popleft()
            if stream.sid in self.streams and self.transport is not None:
                self._flush_stream(stream)
