"""KServe v2 / Triton over HTTP/1.1: a bare ``asyncio.Protocol`` on the httptools parser (llhttp), on the
data plane's own event loop.

Why by hand and not a framework: measured with perf_analyzer on this 2-core machine (bench/serving.py),
the per-request cost of an ASGI stack (scope dicts, receive/send coroutines, routing) is what separates
Python servers from Triton at concurrency 32; a Protocol that parses with llhttp and answers with one
``transport.write`` keeps the HTTP layer to a few microseconds. Everything below the wire is the
:class:`~azulite.serve.types.DataPlane`; this module only converts and routes.

Routes are Triton's (docs/protocol/*.md): health, server and model metadata, ready, config, statistics,
infer (JSON + binary tensor data extension), repository index / load / unload, system shared memory
(serve/shm.py); logging, trace and CUDA shared-memory registration answer 501 with a message (status
queries of CUDA shared memory answer the empty list). Errors are ``{"error": "..."}`` with :data:`HTTP_STATUS`.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import logging
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import httptools

from azulite.errors import InvalidArgument, NotFound, ServeError, Unsupported
from azulite.serve import http_codec as codec
from azulite.serve.auth import Guard, bearer, http_route
from azulite.serve.http_defences import HttpDefences
from azulite.serve.http_stream import StreamedReplies, is_stream
from azulite.serve.limits import ConnectionLimits, close_soon
from azulite.serve.types import DataPlane

log = logging.getLogger("azulite.serve.http")

#: ServeError.status -> HTTP status, the one place it is decided (as Triton's HttpCodeFromError:
#: NOT_FOUND 404, UNAVAILABLE 503, UNSUPPORTED 501, INTERNAL 500, everything else 400).
HTTP_STATUS: dict[str, int] = {
    "INVALID_ARGUMENT": 400,
    "ALREADY_EXISTS": 400,
    "CANCELLED": 400,
    "NOT_FOUND": 404,
    "UNAVAILABLE": 503,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
}
_REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden", 404: b"Not Found", 405: b"Method Not Allowed", 409: b"Conflict",
            408: b"Request Timeout", 413: b"Payload Too Large", 429: b"Too Many Requests", 431: b"Request Header Fields Too Large", 500: b"Internal Server Error", 501: b"Not Implemented",
            503: b"Service Unavailable"}
JSON = b"application/json"
DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024  # Triton's --http-max-input-size default

Reply = tuple[int, bytes, bytes, tuple[tuple[bytes, bytes], ...]]  # status, content type, body, headers


def _header(headers: dict[bytes, bytes], name: str) -> str | None:
    value = headers.get(name.encode("latin-1"))
    return None if value is None else value.decode("latin-1")


_BUSY = json.dumps({"error": "the server has too many open connections; retry later"}).encode()
#: the answer to a connection past ConnectionLimits.max_connections (written before any request is read)
_TOO_MANY_CONNECTIONS = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY), _BUSY))


class _Stop(Exception):
    """Raised from a parser callback: stop parsing this connection's input."""


class _MethodNotAllowed(InvalidArgument):
    """An HTTP-only answer (405, as Triton): the path exists, not with this method."""


def error_reply(exc: BaseException) -> Reply:
    """Any exception -> Triton's error JSON. Client mistakes are ServeErrors with a 4xx status; anything
    else is the server's fault (500) and is logged with its traceback."""
    if isinstance(exc, _MethodNotAllowed):
        return 405, JSON, json.dumps({"error": str(exc)}).encode(), ()
    extra: tuple[tuple[bytes, bytes], ...] = ()
    if isinstance(exc, ServeError):
        status, message = HTTP_STATUS.get(exc.status, 500), str(exc)
        if status == 429 or status == 503:  # rate limit, quota, full queue: say when to come back
            extra = ((b"Retry-After", b"%d" % getattr(exc, "retry_after_s", 1)),)
        elif status == 401:
            extra = ((b"WWW-Authenticate", b"Bearer"),)
    else:
        log.exception("internal error answering a request", exc_info=exc)
        status, message = 500, f"internal error: {type(exc).__name__}: {exc}"
    return status, JSON, json.dumps({"error": message}).encode(), extra


def _json_reply(doc: Any, status: int = 200) -> Reply:
    return status, JSON, json.dumps(doc, separators=(",", ":")).encode(), ()


_EMPTY_OK: Reply = (200, JSON, b"", ())


def _parse_json_body(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"malformed JSON body: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return doc


def _decompress(body: bytes, encoding: bytes | None) -> bytes:
    if not encoding or encoding in (b"identity",):
        return body
    try:
        if encoding == b"gzip":
            return gzip.decompress(body)
        if encoding == b"deflate":
            return zlib.decompress(body)
    except (OSError, zlib.error, EOFError) as exc:
        raise InvalidArgument(f"the body is not valid {encoding.decode()} data: {exc}") from None
    raise Unsupported(f"Content-Encoding {encoding.decode(errors='replace')!r} is not supported",
                      fix="send gzip, deflate or an uncompressed body")


class HttpApp:
    """The route table: (method, path, headers, body) -> Reply. Separate from the socket code so the
    metrics port reuses the protocol with its own app."""

    def __init__(self, dataplane: DataPlane, guard: Guard | None = None) -> None:
        self.dp = dataplane
        self.guard = guard

    async def handle(self, method: bytes, path: str, headers: dict[bytes, bytes], body: bytes,
                     client: str = "") -> Reply:
        if self.guard is not None:
            return await self._guarded(method, path, headers, body, client)
        try:
            result = self.dispatch(method, path, headers, body)
            if isinstance(result, Awaitable):
                return await result
            return result
        except Exception as exc:  # noqa: BLE001 - every failure becomes an HTTP answer
            return error_reply(exc)

    async def _guarded(self, method: bytes, path: str, headers: dict[bytes, bytes], body: bytes,
                       client: str) -> Reply:
        """Keys, restricted APIs and limits before the route; the audit line after it."""
        start = time.perf_counter()
        category, model, version = http_route(path)
        principal = None
        try:
            token = bearer(headers.get(b"authorization")) if self.guard.auth else None
            principal = self.guard.check("http", category, model, token, headers, _header)
            if principal.models is not None and not model and category == "statistics":
                stats = self.dp.model_statistics("", "")
                keep = [s for s in stats.model_stats if principal.may_see(s.name)]
                del stats.model_stats[:]
                stats.model_stats.extend(keep)
                reply = _json_reply(codec.message_to_json(stats))
            elif principal.models is not None and category == "model-repository" and path.rstrip("/").endswith(
                    "/index"):
                index = self.dp.repository_index(bool(_parse_json_body(body).get("ready", False)))
                keep = [m for m in index.models if principal.may_see(m.name)]
                del index.models[:]
                index.models.extend(keep)
                reply = _json_reply(codec.repository_index_json(index))
            else:
                result = self.dispatch(method, path, headers, body)
                reply = await result if isinstance(result, Awaitable) else result
        except Exception as exc:  # noqa: BLE001 - every failure becomes an HTTP answer
            reply = error_reply(exc)
        audit = self.guard.audit
        if audit is not None:
            rid = headers.get(b"x-request-id")
            audit.record(rid.decode("latin-1") if rid else None, principal.key_id if principal is not None else None,
                         client, model, version, "http", reply[0], time.perf_counter() - start, len(body),
                         0 if is_stream(reply[2]) else len(reply[2]))
        return reply

    def dispatch(self, method: bytes, path: str, headers: dict[bytes, bytes], body: bytes):
        parts = [unquote(p) for p in path.split("?", 1)[0].strip("/").split("/")]
        if not parts or parts[0] != "v2":
            raise NotFound(f"no such endpoint: {method.decode()} {path}", fix="KServe v2 paths start with /v2")
        rest = parts[1:]
        get, post = method == b"GET", method == b"POST"
        if not rest:
            self._method(get, method, path)
            return _json_reply(codec.server_metadata_json(self.dp.server_metadata()))
        head = rest[0]
        if head == "models":
            return self._models(method, path, rest[1:], headers, body)
        if head == "health" and len(rest) == 2 and rest[1] in ("live", "ready"):
            self._method(get, method, path)
            ok = self.dp.live() if rest[1] == "live" else self.dp.ready()
            return (200 if ok else 400), JSON, b"", ()
        if head == "repository":
            return self._repository(post, method, path, rest[1:], body)
        if head == "systemsharedmemory":
            return self._system_shared_memory(rest[1:], method, path, body)
        if head == "cudasharedmemory":
            return self._shared_memory(head, rest[1:], method, path)
        if head == "logging" or head == "trace":
            raise Unsupported(f"the {head} extension is not supported by azulite",
                              fix="use the server's own log output and the metrics endpoint")
        raise NotFound(f"no such endpoint: {method.decode()} {path}")

    @staticmethod
    def _method(ok: bool, method: bytes, path: str) -> None:
        if not ok:
            raise _MethodNotAllowed(f"method {method.decode()} is not allowed on {path}")

    def _models(self, method: bytes, path: str, rest: list[str], headers, body: bytes):
        get, post = method == b"GET", method == b"POST"
        if rest == ["stats"]:
            self._method(get, method, path)
            return _json_reply(codec.message_to_json(self.dp.model_statistics("", "")))
        if not rest or not rest[0]:
            raise NotFound(f"no such endpoint: {method.decode()} {path}", fix="name a model: /v2/models/NAME")
        name, version, tail = rest[0], "", rest[1:]
        if len(tail) >= 2 and tail[0] == "versions":
            version, tail = tail[1], tail[2:]
        action = tail[0] if len(tail) == 1 else ("" if not tail else None)
        if action == "infer":
            self._method(post, method, path)
            return self._infer(name, version, headers, body)
        if action == "":
            self._method(get, method, path)
            return _json_reply(codec.model_metadata_json(self.dp.model_metadata(name, version)))
        if action == "ready":
            self._method(get, method, path)
            return (200 if self.dp.model_ready(name, version) else 400), JSON, b"", ()
        if action == "config":
            self._method(get, method, path)
            return _json_reply(codec.message_to_json(self.dp.model_config(name, version)))
        if action == "stats":
            self._method(get, method, path)
            return _json_reply(codec.message_to_json(self.dp.model_statistics(name, version)))
        if action in ("generate", "generate_stream"):
            self._method(post, method, path)
            return self._generate(name, version, body, action == "generate_stream")
        if action == "trace":
            raise Unsupported("the trace extension is not supported by azulite")
        raise NotFound(f"no such endpoint: {method.decode()} {path}")

    async def _generate(self, name: str, version: str, body: bytes, stream: bool) -> Reply:
        from azulite.serve import generate  # Triton's generate extension (serve/generate.py)

        if stream:
            return 200, generate.SSE, await generate.generate_stream(self.dp, name, version, body), ()  # type: ignore[return-value]
        return 200, JSON, await generate.generate(self.dp, name, version, body), ()

    async def _infer(self, name: str, version: str, headers: dict[bytes, bytes], body: bytes) -> Reply:
        body = _decompress(body, headers.get(b"content-encoding"))
        raw_len = headers.get(b"inference-header-content-length")
        header_length = None
        if raw_len is not None:
            try:
                header_length = int(raw_len)
            except ValueError:
                raise InvalidArgument(f"Inference-Header-Content-Length is not an integer: {raw_len!r}") from None
        request = codec.decode_infer_request(name, version, body, header_length)
        response = await self.dp.infer(request)
        out, hlen = codec.encode_infer_response(response, request)
        if hlen is None:
            return 200, JSON, out, ()
        return 200, b"application/octet-stream", out, ((b"Inference-Header-Content-Length", str(hlen).encode()),)

    def _repository(self, post: bool, method: bytes, path: str, rest: list[str], body: bytes):
        self._method(post, method, path)
        if rest == ["index"]:
            doc = _parse_json_body(body)
            return _json_reply(codec.repository_index_json(self.dp.repository_index(bool(doc.get("ready", False)))))
        if len(rest) == 3 and rest[0] == "models" and rest[2] in ("load", "unload"):
            return self._load_unload(rest[1], rest[2], _parse_json_body(body))
        raise NotFound(f"no such endpoint: {method.decode()} {path}")

    async def _load_unload(self, name: str, action: str, doc: dict[str, Any]) -> Reply:
        params = doc.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidArgument("'parameters' must be a JSON object")
        if action == "unload":
            await self.dp.unload_model(name, bool(params.get("unload_dependents", False)))
            return _EMPTY_OK
        load_params: dict[str, Any] = {}
        for key, value in params.items():
            if key.startswith("file:"):
                try:  # Triton's HTTP load sends file contents base64-encoded
                    load_params[key] = base64.b64decode(value, validate=True)
                except (ValueError, TypeError):
                    raise InvalidArgument(f"load parameter '{key}' must be base64-encoded file content") from None
            else:
                load_params[key] = value
        await self.dp.load_model(name, load_params or None)
        return _EMPTY_OK

    def _system_shared_memory(self, rest: list[str], method: bytes, path: str, body: bytes):
        """Triton's systemsharedmemory routes: [region/NAME/](status|register|unregister)."""
        get, post = method == b"GET", method == b"POST"
        name = ""
        if len(rest) == 3 and rest[0] == "region":
            name, rest = rest[1], rest[2:]
        action = rest[0] if len(rest) == 1 else None
        if action == "status":
            self._method(get, method, path)
            return _json_reply([{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                                for r in self.dp.shm.status(name)])
        if action == "unregister":
            self._method(post, method, path)
            self.dp.shm.unregister(name)
            return _EMPTY_OK
        if action == "register" and name:
            self._method(post, method, path)
            doc = _parse_json_body(body)
            self.dp.shm.register(name, doc.get("key"), doc.get("offset", 0), doc.get("byte_size"))
            return _EMPTY_OK
        raise NotFound(f"no such endpoint: {method.decode()} {path}",
                       fix="use /v2/systemsharedmemory[/region/NAME]/status|unregister or .../region/NAME/register")

    @staticmethod
    def _shared_memory(kind: str, rest: list[str], method: bytes, path: str):
        if rest and rest[-1] == "status":
            return _json_reply([])
        if rest and rest[-1] == "unregister":
            return _EMPTY_OK  # nothing is ever registered: unregistering leaves nothing registered
        what = "system" if kind == "systemsharedmemory" else "CUDA"
        raise Unsupported(f"{what} shared memory is not supported by azulite",
                          fix="send tensors in the request body (binary tensor data extension)")


class MetricsApp:
    """The metrics port: GET /metrics in Prometheus text format."""

    def __init__(self, render: Callable[[], bytes], content_type: str) -> None:
        self.render = render
        self.content_type = content_type.encode()

    async def handle(self, method: bytes, path: str, headers, body: bytes, client: str = "") -> Reply:
        if path.split("?", 1)[0] == "/metrics":
            try:
                return 200, self.content_type, self.render(), ()
            except Exception as exc:  # noqa: BLE001
                return error_reply(exc)
        return error_reply(NotFound(f"no such endpoint: {path}", fix="metrics are at /metrics"))


class _Connection(HttpDefences, StreamedReplies, asyncio.Protocol):
    """One HTTP/1.1 connection. Requests are answered in arrival order (pipelining-safe): each request's
    reply goes into a FIFO; replies are written as soon as every earlier one is."""

    __slots__ = ("server", "transport", "parser", "url", "headers", "body", "body_size", "too_large",
                 "replies", "closing", "peer", "head_size", "head_tick", "stall_timer", "read_paused",
                 "write_paused", "streaming")

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
        self.stall_timer: asyncio.TimerHandle | None = None
        self.read_paused = False  # too many pipelined requests ahead of their answers
        self.write_paused = False  # the client does not read its answers
        self.streaming = False  # a streamed answer is being written (http_stream.py)

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer or "")
        limit = self.server.limits.max_connections
        if limit and len(self.server.connections) >= limit:  # a connection flood: refuse, keep the others
            self.closing = True
            transport.write(_TOO_MANY_CONNECTIONS)
            transport.close()
            return
        transport.set_write_buffer_limits(high=self.server.limits.max_write_buffer)
        self.server.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.transport = None
        if self.stall_timer is not None:
            self.stall_timer.cancel()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return  # answered and closing: what else arrives is not parsed
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            pass  # a callback refused the request (_Stop): already answered
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrade is not supported")
        except httptools.HttpParserError as exc:
            if not self.too_large:
                self._fail(400, f"malformed HTTP request: {exc}")

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = {}
        self.body = []
        self.body_size = 0
        self.head_size = 0
        self.head_tick = self.server.tick  # the server's sweep closes heads older than two ticks

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_size += len(url)
        if self.head_size > self.server.limits.max_header_bytes:
            self._head_too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value
        self.head_size += len(name) + len(value) + 4
        if self.head_size > self.server.limits.max_header_bytes:
            self._head_too_large()

    def _head_too_large(self) -> None:
        if not self.closing:
            self._fail(431, f"the request head is larger than {self.server.limits.max_header_bytes} bytes")
        raise _Stop  # llhttp stops parsing this connection's input

    def on_headers_complete(self) -> None:
        self.head_tick = -1
        length = self.headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_input_size:
            self._too_large(int(length))
        elif (self.headers.get(b"expect", b"").lower() == b"100-continue" and self.transport is not None
              and not self.replies):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits for it on large bodies

    def on_body(self, body: bytes) -> None:
        if self.too_large:
            return
        self.body_size += len(body)
        if self.body_size > self.server.max_input_size:
            self._too_large(self.body_size)
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.too_large or self.closing:
            return
        method = self.parser.get_method()
        keep_alive = self.parser.should_keep_alive()
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        slot = [None, keep_alive]
        self.replies.append(slot)
        if len(self.replies) >= self.server.limits.max_pipelined:
            self._reading()
        try:
            path = self.url.decode("latin-1")
            coro = self.server.app.handle(method, path, self.headers, body, self.peer)
        except Exception as exc:  # noqa: BLE001
            slot[0] = error_reply(exc)
            self._flush()
            return
        task = asyncio.ensure_future(coro)
        self.server.in_flight += 1
        task.add_done_callback(lambda t, slot=slot: self._done(t, slot))

    def _done(self, task: asyncio.Future, slot: list) -> None:
        self.server.in_flight -= 1
        try:
            slot[0] = task.result()
        except BaseException as exc:  # noqa: BLE001 - cancelled or a bug: still answer
            slot[0] = error_reply(exc if isinstance(exc, Exception) else ServeError("request cancelled"))
        self._flush()
        self.server.check_idle()

    def _flush(self) -> None:
        try:
            self._write_ready()
        finally:
            if self.read_paused and len(self.replies) <= self.server.limits.max_pipelined // 2:
                self._reading()

    def _write_ready(self) -> None:
        while self.replies and self.replies[0][0] is not None and not self.streaming:
            reply, keep_alive = self.replies.popleft()
            if self.transport is None:
                continue
            if is_stream(reply[2]):
                self._write_stream(reply, keep_alive and not self.server.stopping, _REASONS)
                return
            self._write(reply, keep_alive and not self.server.stopping)
            if not keep_alive or self.server.stopping:
                close_soon(self.transport, self.server.limits)
                self.transport = None

    def _write(self, reply: Reply, keep_alive: bool) -> None:
        status, ctype, body, extra = reply
        head = [b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
                % (status, _REASONS.get(status, b"Unknown"), ctype, len(body))]
        for k, v in extra:
            head.append(b"%s: %s\r\n" % (k, v))
        if not keep_alive:
            head.append(b"Connection: close\r\n")
        head.append(b"\r\n")
        self.transport.write(b"".join(head) + body if len(body) < 65536 else b"".join(head))
        if len(body) >= 65536:
            self.transport.write(body)

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
        if any(slot[0] is None for slot in self.replies):  # earlier requests still running: drop, close
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
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True,
                                                reuse_port=self.reuse_port or None,
                                                backlog=1024)
        self._sweeper = loop.call_later(self.limits.header_timeout_s / 2, self._sweep)
        return self._server.sockets[0].getsockname()[1]

    def _sweep(self) -> None:
        """Slowloris: every half header timeout, close connections whose request head began two ticks
        ago (so after between one and 1.5 timeouts). One timer per server, not one per request."""
        self.tick += 1
        for conn in list(self.connections):
            if conn.head_tick >= 0 and self.tick - conn.head_tick >= 2 and not conn.read_paused:
                conn._head_timeout()
        self._sweeper = asyncio.get_running_loop().call_later(self.limits.header_timeout_s / 2, self._sweep)

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
