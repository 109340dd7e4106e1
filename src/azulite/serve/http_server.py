"""The HTTP/1.1 transport of serve/http.py's routes: a bare ``asyncio.Protocol`` on the httptools parser
(llhttp), one per connection, answering in request order with one ``transport.write`` per flush; the
per-connection defences (serve/http_defences.py) and streamed replies (serve/http_stream.py) are mixed in.
Why by hand and not a framework: see serve/http.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections import deque
from functools import partial
from time import monotonic_ns

import httptools

from azulite.errors import ServeError
from azulite.serve.api_routes import TWO_CREDENTIALS
from azulite.serve.http_defences import HttpDefences
from azulite.serve.http_replies import DEFAULT_MAX_INPUT_SIZE, JSON, REASONS, Reply, Stop, error_reply
from azulite.serve.http_stream import StreamedReplies, is_stream
from azulite.serve.limits import ConnectionLimits, close_soon
from azulite.serve.trace import TracedReply

log = logging.getLogger("azulite.serve.http")
_TWO_CREDENTIALS = TWO_CREDENTIALS.encode("latin-1")

_BUSY = json.dumps({"error": "the server has too many open connections; retry later"}).encode()
_TOO_MANY_CONNECTIONS = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY), _BUSY))


#: (status, content type) -> the answer head up to its Content-Length value, built once: a server answers
#: few distinct pairs (bounded all the same: past _HEADS_CACHED pairs, heads are built and not kept)
_HEADS: dict[tuple[int, bytes], bytes] = {}
_HEADS_CACHED = 256


def _head_prefix(status: int, ctype: bytes) -> bytes:
    prefix = (b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: "
              % (status, REASONS.get(status, b"Unknown"), ctype))
    if len(_HEADS) < _HEADS_CACHED:
        _HEADS[(status, ctype)] = prefix
    return prefix


class _Connection(HttpDefences, StreamedReplies, asyncio.Protocol):
    """One HTTP/1.1 connection. Requests are answered in arrival order (pipelining-safe): each request's
    reply goes into a FIFO; replies are written as soon as every earlier one is."""

    __slots__ = ("server", "transport", "parser", "url", "headers", "body", "body_size", "too_large",
                 "replies", "closing", "peer", "head_size", "head_tick", "body_tick", "last_active",
                 "stall_timer", "read_paused",
                 "write_paused", "streaming", "deferred", "max_head", "loop", "head_reads", "recv_start")

    def __init__(self, server: "HttpServer") -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.body_size = 0
        self.too_large = False
        self.replies: deque[list] = deque()  # [reply-or-None, keep_alive]
        self.closing = False
        self.peer = ""
        self.head_size = 0
        self.head_tick = -1  # server tick at which the current request head began; -1: none pending
        self.body_tick = -1  # server tick of the current request body's last bytes; -1: no body pending
        self.last_active = next(server.order)  # when its last request began, in order: the idle one longest goes first
        self.stall_timer: asyncio.TimerHandle | None = None
        self.read_paused = False  # too many pipelined requests ahead of their answers
        self.write_paused = False  # the client does not read its answers
        self.streaming = False  # a streamed answer is being written (http_stream.py)
        # requests parsed from a read that was already under way when pipelining reached its limit
        # (pause_reading stops the next read, not the parse of this one): started as answers drain, so
        # no more than max_pipelined of a connection's requests ever run at once
        self.deferred: deque[tuple] = deque()
        self.max_head = server.limits.max_header_bytes  # read by every header callback: one load, not three
        self.loop: asyncio.AbstractEventLoop | None = None
        # bytes of the reads that began and ended inside the current request head (-1: the head began in
        # the read being parsed); see data_received
        self.head_reads = -1
        self.recv_start = 0  # when the current request began to arrive (a trace's HTTP_RECV_START)

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer or "")
        limit = self.server.limits.max_connections
        if limit and len(self.server.connections) >= limit and not self.server.evict_idle():
            self.closing = True  # a connection flood: refuse, keep the others (none of them was idle)
            transport.write(_TOO_MANY_CONNECTIONS)
            transport.close()
            return
        transport.set_write_buffer_limits(high=self.server.limits.max_write_buffer)
        self.server.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.transport = None
        self.deferred.clear()
        if self.stall_timer is not None:
            self.stall_timer.cancel()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return  # answered and closing: what else arrives is not parsed
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            return  # a callback refused the request (Stop): already answered
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrade is not supported")
            return
        except httptools.HttpParserError as exc:
            if not self.too_large:
                self._fail(400, f"malformed HTTP request: {exc}")
            return
        if self.head_tick >= 0:
            # A head still incomplete after this read. on_url/on_header bound the head's complete parts,
            # but httptools holds a header name or value until it ends, growing it by concatenation (its
            # memory unbounded, its CPU quadratic: 4 MiB of one value sent in 1 KiB reads cost 3.4
            # CPU-seconds here). Every byte of a read that began and ended inside the head is head, so
            # their sum past the limit is a head past the limit, counted without a false alarm.
            if self.head_reads < 0:
                self.head_reads = 0  # it began in this read: how much of the read is head is unknown
            else:
                self.head_reads += len(data)
                if self.head_reads > self.max_head and not self.closing:
                    self._fail(431, f"the request head is larger than {self.max_head} bytes")

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = {}
        self.body = []
        self.body_size = 0
        self.head_size = 0
        self.head_reads = -1
        self.head_tick = self.server.tick  # the sweep closes heads three ticks old
        self.last_active = next(self.server.order)
        self.recv_start = monotonic_ns()

    def on_url(self, url: bytes) -> None:
        self.url += url
        size = self.head_size = self.head_size + len(url)
        if size > self.max_head:
            self._head_too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"authorization" and name in self.headers:  # two credentials: refused (api_routes.bearer)
            value = _TWO_CREDENTIALS
        self.headers[name] = value
        size = self.head_size = self.head_size + len(name) + len(value) + 4
        if size > self.max_head:
            self._head_too_large()

    def _head_too_large(self) -> None:
        if not self.closing:
            self._fail(431, f"the request head is larger than {self.server.limits.max_header_bytes} bytes")
        raise Stop  # llhttp stops parsing this connection's input

    def on_headers_complete(self) -> None:
        self.head_tick = -1
        self.body_tick = self.server.tick  # a body that stops arriving is cut off as a head is
        length = self.headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_input_size:
            self._too_large(int(length))
        elif (b"expect" in self.headers and self.headers[b"expect"].lower() == b"100-continue"
              and self.transport is not None and not self.replies):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits for it on large bodies

    def on_body(self, body: bytes) -> None:
        self.body_tick = self.server.tick  # progress: the timeout counts from the last bytes
        if self.too_large:
            return
        self.body_size += len(body)
        if self.body_size > self.server.max_input_size:
            self._too_large(self.body_size)
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.body_tick = -1
        if self.too_large or self.closing:
            return
        method = self.parser.get_method()
        keep_alive = self.parser.should_keep_alive()
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        # when it was received, for a trace (serve/trace.py): names no client header can have (no ':' in one)
        headers = self.headers
        headers[b":recv-start"] = self.recv_start
        headers[b":recv-end"] = monotonic_ns()
        if self.deferred or len(self.replies) >= self.server.limits.max_pipelined:
            self.deferred.append((method, self.url, headers, body, keep_alive))
            return
        self._dispatch(method, self.url, headers, body, keep_alive)

    def _dispatch(self, method: bytes, url: bytes, headers: dict[bytes, bytes], body: bytes,
                  keep_alive: bool) -> None:
        slot = [None, keep_alive]
        self.replies.append(slot)
        if len(self.replies) >= self.server.limits.max_pipelined:
            self._reading()
        try:
            path = url.decode("latin-1")
            coro = self.server.app.handle(method, path, headers, body, self.peer)
        except Exception as exc:  # noqa: BLE001
            slot[0] = error_reply(exc)
            self._flush()
            return
        # the loop's create_task, not ensure_future (two Python frames and type checks less per request);
        # partial, not a lambda: the done callback is called from C without a Python frame of its own.
        # Not an eager task: Python 3.11 has none (asyncio.eager_task_factory is 3.12+), and an infer
        # request awaits its batch, so it would not finish in its first step anyway.
        # an infer request the data plane answers by callback comes as a future (HttpApp._infer_now): no Task
        task = coro if isinstance(coro, asyncio.Future) else (self.loop or asyncio.get_running_loop()).create_task(coro)
        self.server.in_flight += 1
        task.add_done_callback(partial(self._done, slot))

    def _done(self, slot: list, task: asyncio.Future) -> None:
        server = self.server
        server.in_flight -= 1
        try:
            reply = slot[0] = task.result()
        except BaseException as exc:  # noqa: BLE001 - cancelled or a bug: still answer
            reply = slot[0] = error_reply(exc if isinstance(exc, Exception) else ServeError("request cancelled"))
        replies = self.replies
        if (len(replies) == 1 and replies[0] is slot and not self.deferred and not self.streaming
                and not self.read_paused and self.transport is not None and slot[1] and not server.stopping
                and type(reply[2]) is bytes):
            # the common case, a keep-alive connection's only answer pending: what _flush would do, without
            # its three calls (an answer behind another, a stream, a close or a drain take _flush's way)
            replies.popleft()
            self._write(reply, True)
        else:
            self._flush()
        if server.in_flight == 0:
            server.check_idle()

    def _flush(self) -> None:
        try:
            self._write_ready()
        finally:
            limit = self.server.limits.max_pipelined
            while self.deferred and len(self.replies) < limit and self.transport is not None and not self.closing:
                self._dispatch(*self.deferred.popleft())
            if self.read_paused and not self.deferred and len(self.replies) <= limit // 2:
                self._reading()

    def _write_ready(self) -> None:
        while self.replies and self.replies[0][0] is not None and not self.streaming:
            reply, keep_alive = self.replies.popleft()
            if self.transport is None:
                if reply.__class__ is TracedReply:
                    reply.trace.sent(0, 0)  # the client is gone: nothing sent
                continue
            if is_stream(reply[2]):
                self._write_stream(reply, keep_alive and not self.server.stopping, REASONS)
                return
            self._write(reply, keep_alive and not self.server.stopping)
            if not keep_alive or self.server.stopping:
                close_soon(self.transport, self.server.limits)
                self.transport = None

    def _write(self, reply: Reply, keep_alive: bool) -> None:
        status, ctype, body, extra = reply
        prefix = _HEADS.get((status, ctype))
        if prefix is None:
            prefix = _head_prefix(status, ctype)
        tail = b"\r\n\r\n" if keep_alive else b"\r\nConnection: close\r\n\r\n"
        if extra:
            tail = b"\r\n" + b"".join([b"%s: %s\r\n" % (k, v) for k, v in extra]) + tail[2:]
        traced = reply.__class__ is TracedReply
        if traced:
            start = monotonic_ns()
        if len(body) < 65536:  # one write, one copy of the body
            self.transport.write(b"%s%d%s%s" % (prefix, len(body), tail, body))
        else:
            self.transport.write(b"%s%d%s" % (prefix, len(body), tail))
            self.transport.write(body)
        if traced:  # HTTP_SEND_START/END, as Triton's bracket its send of the answer
            reply.trace.sent(start, monotonic_ns())

    def _too_large(self, size: int) -> None:
        self.too_large = True
        limit = self.server.max_input_size
        self._fail(413, f"request body of {size} bytes exceeds the maximum allowed of {limit} bytes "
                        f"(--http-max-input-size)")

    def _fail(self, status: int, message: str) -> None:
        """A request that cannot be parsed: answer it (after earlier replies) and close the connection."""
        self.closing = True
        if self.transport is None:
            return
        body = json.dumps({"error": message}).encode()
        if self.deferred or any(slot[0] is None for slot in self.replies):  # earlier ones unanswered: drop, close
            close_soon(self.transport, self.server.limits)
            return
        self._flush()
        if self.transport is not None:
            self._write((status, JSON, body, ()), False)
            close_soon(self.transport, self.server.limits)
            self.transport = None


class HttpServer:
    """Listens on one address and serves ``app`` (an HttpApp or MetricsApp) on the running loop."""

    reuse_port = False  # SO_REUSEPORT: the front-ends of a multi-worker server share the port

    def __init__(self, app, *, max_input_size: int = DEFAULT_MAX_INPUT_SIZE,
                 limits: ConnectionLimits | None = None) -> None:
        self.app = app
        self.max_input_size = max_input_size
        self.limits = limits or ConnectionLimits()
        self.connections: set[_Connection] = set()
        self.in_flight = 0
        self.stopping = False
        self._server: asyncio.base_events.Server | None = None
        self._idle: asyncio.Event | None = None
        self.tick = 0
        self.order = itertools.count()  # the order requests began in (which idle connection is oldest)
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True,
                                                reuse_port=self.reuse_port or None,
                                                backlog=1024)
        self._sweeper = loop.call_later(self.limits.header_timeout_s / 2, self._sweep)
        return self._server.sockets[0].getsockname()[1]

    def _sweep(self) -> None:
        """Slowloris: every half header timeout, close connections whose request head began three ticks
        ago, or whose request body has not moved for three (so after between one and 1.5 timeouts; it was
        two ticks, between a half and one). One timer per server, not one per request."""
        self.tick += 1
        for conn in list(self.connections):
            if conn.read_paused:
                continue
            if conn.head_tick >= 0 and self.tick - conn.head_tick >= 3:
                conn._head_timeout()
            elif conn.body_tick >= 0 and self.tick - conn.body_tick >= 3:
                conn._body_timeout()
        self._sweeper = asyncio.get_running_loop().call_later(self.limits.header_timeout_s / 2, self._sweep)

    def evict_idle(self) -> bool:
        """At --max-connections: close the connection idle longest (kept alive, no request under way, no
        answer pending) to make room, as a server short of connections does; False when none is idle. A
        client holding idle connections no longer keeps everyone else out (liveness probes included)."""
        idle = [c for c in self.connections if c.transport is not None and not c.closing and c.head_tick < 0
                and c.body_tick < 0 and not c.replies and not c.deferred and not c.streaming]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.last_active)
        log.info("HTTP connection from %s closed: idle, and a new one came at --max-connections", oldest.peer)
        self.connections.discard(oldest)
        oldest.closing = True
        oldest.transport.close()
        return True

    def check_idle(self) -> None:
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    def stop_accepting(self) -> None:
        """Close the listening socket; connections stay open to finish what they started."""
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()

    async def drain(self, timeout_s: float) -> None:
        """Wait for in-flight requests to be answered (up to timeout_s), then close every connection."""
        self.stop_accepting()
        if self.in_flight:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                log.warning("HTTP: %d requests still in flight after %.1fs; closing", self.in_flight, timeout_s)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
