"""KServe v2 / Triton over HTTP/1.1: the routes and replies. The transport under them (serve/http_server.py)
is a bare ``asyncio.Protocol`` on the httptools parser (llhttp), on the data plane's own event loop.

Why by hand and not a framework: measured with perf_analyzer on this 2-core machine (bench/serving.py),
the per-request cost of an ASGI stack (scope dicts, receive/send coroutines, routing) is what separates
Python servers from Triton at concurrency 32; a Protocol that parses with llhttp and answers with one
``transport.write`` keeps the HTTP layer to a few microseconds. Everything below the wire is the
:class:`~azulite.serve.types.DataPlane`; this module only converts and routes.

Routes are Triton's (docs/protocol/*.md): health, server and model metadata, ready, config, statistics,
infer (JSON + binary tensor data extension), repository index / load / unload, system and CUDA shared
memory (serve/shm.py, serve/cuda_shm.py: CUDA registration answers 501 naming what is missing on a server
without a GPU), logging (serve/log_settings.py), trace settings (serve/trace.py). Errors are
``{"error": "..."}`` with ``HTTP_STATUS`` (serve/http_replies.py, the replies' vocabulary).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from time import perf_counter as _perf
from typing import Any
from urllib.parse import unquote

from azulite.errors import InvalidArgument, NotFound, ServeError
from azulite.serve.repository import refuse_repository_name
from azulite.serve import http_codec as codec
from azulite.serve import log_settings
from azulite.serve.api_routes import http_route
from azulite.serve.auth import Guard, refused_key
from azulite.serve.http_replies import (DEFAULT_MAX_INPUT_SIZE, EMPTY_OK, JSON, MethodNotAllowed, Reply, decompress,
                                        error_reply, json_reply, ok_reply, parse_json_body, response_encoding,
                                        traced_reply)
from azulite.serve.http_stream import is_stream
from azulite.serve.otel import traceparent_of
from azulite.serve.types import DataPlane, InferRequest, InferResponse

log = logging.getLogger("azulite.serve.http")

_ROUTES_CACHED = 1024  # infer paths HttpApp remembers the route of


def _header(headers: dict[bytes, bytes], name: str) -> str | None:
    value = headers.get(name.encode("latin-1"))
    return None if value is None else value.decode("latin-1")


def _decode(name: str, version: str, headers: dict[bytes, bytes], body: bytes, limit: int) -> InferRequest:
    """An infer request's body, decompressed (at most ``limit`` bytes) and decoded (raises InvalidArgument,
    PayloadTooLarge)."""
    encoding = headers.get(b"content-encoding")
    if encoding is not None:
        body = decompress(body, encoding, limit)
    raw_len = headers.get(b"inference-header-content-length")
    header_length = None
    if raw_len is not None:
        try:
            header_length = int(raw_len)
        except ValueError:
            raise InvalidArgument(f"Inference-Header-Content-Length is not an integer: {raw_len!r}") from None
    request = codec.decode_infer_request(name, version, body, header_length)
    start = headers.get(b":recv-start")  # when the transport received it (serve/http_server.py), for a trace
    if start is not None:
        request.front_end, request.recv_start, request.recv_end = "HTTP", start, headers[b":recv-end"]
    if b"traceparent" in headers:  # the caller's W3C trace context (serve/otel.py)
        request.trace_context = traceparent_of(headers.items())
    return request


def _encoded(request: InferRequest, reply: asyncio.Future, encoding: bytes | None, response: InferResponse | None,
             error: BaseException | None) -> None:
    """The data plane's answer to an infer request (HttpApp._infer_now): its reply set on ``reply``, as
    _infer would return it (a cancelled one as the transport answers a cancelled task); compressed with
    ``encoding`` (serve/http_replies.response_encoding)."""
    if error is None:
        try:
            ok = ok_reply(*codec.encode_infer_response(response, request), encoding)
        except Exception as exc:  # noqa: BLE001
            error = exc
        else:
            reply.set_result(ok if response.trace is None else traced_reply(ok, response.trace))
            return
    failed = error_reply(error if isinstance(error, Exception) else ServeError("request cancelled"))
    reply.set_result(failed if response is None or response.trace is None else traced_reply(failed, response.trace))


def _encoded_audited(app: HttpApp, request: InferRequest, reply: asyncio.Future, headers: dict[bytes, bytes],
                     name: str, version: str, audited: tuple, response: InferResponse | None,
                     error: BaseException | None) -> None:
    """_encoded, then the guarded request's audit line (HttpApp._infer_start)."""
    _encoded(request, reply, response_encoding(headers), response, error)
    app._audit_line(headers, name, version, audited, reply.result())


def _task_encoded(then: Callable, task: asyncio.Task) -> None:
    """``then`` (_encoded or _encoded_audited, bound to the request) for the data plane's general path (a
    Task of its ``infer``)."""
    if task.cancelled():
        then(None, asyncio.CancelledError())
    elif task.exception() is not None:
        then(None, task.exception())
    else:
        then(task.result(), None)


class HttpApp:
    """The route table: (method, path, headers, body) -> Reply. Separate from the socket code so the
    metrics port reuses the protocol with its own app."""

    def __init__(self, dataplane: DataPlane, guard: Guard | None = None, *,
                 max_input_size: int = DEFAULT_MAX_INPUT_SIZE) -> None:
        self.dp = dataplane
        self.guard = guard
        #: --http-max-input-size, for a body once inflated (the transport checks it as sent)
        self.max_input_size = max_input_size
        #: path -> (model, version) of infer paths already routed: an infer request skips the split and
        #: unquote of its path (bounded: a client sending endless distinct paths only stops the caching)
        self._infer_routes: dict[str, tuple[str, str]] = {}
        #: the guard may take the route's own clock read as its ``now`` (one read, not two)
        self._now_is_perf = guard is not None and guard.now_is_perf_counter
        #: the data plane's callback-style infer (TritonDataPlane.infer_then), once a loop runs
        self._infer_then: Callable | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle(self, method: bytes, path: str, headers: dict[bytes, bytes], body: bytes,
               client: str = "") -> Awaitable[Reply]:
        """The request's answer, to await. A plain function handing back one coroutine or another: an
        ``async def`` here would put one more coroutine on every request's await chain. With a guard, its
        check (Guard.check_http, one call) runs here, before any coroutine: a guarded infer request the
        guard routed is then, as an unguarded one, the one ``_infer`` coroutine (its audit line packed at
        its end); any other request, and a refusal, go through ``_guarded``."""
        guard = self.guard
        if guard is not None:
            start = _perf()
            try:
                hit = guard.check_http(headers.get(b"authorization") if guard.auth else None, path, headers, _header,
                                       start if self._now_is_perf else None)
            except Exception as exc:  # noqa: BLE001 - refused (or failed): answered and audited there
                return self._guarded(None, exc, method, path, headers, body, client, start)
            if hit[5] and method == b"POST":  # an infer path: the guard checked the key reaches its model
                return self._infer_now(hit[3], hit[4], headers, body,
                                       None if guard.audit is None else (start, hit[0].key_id, client, len(body)))
            return self._guarded(hit, None, method, path, headers, body, client, start)
        route = self._infer_routes.get(path)
        if route is not None and method == b"POST":  # an infer path seen before: a future of its answer
            return self._infer_now(route[0], route[1], headers, body)
        return self._unguarded(method, path, headers, body)

    def _infer_now(self, name: str, version: str, headers: dict[bytes, bytes], body: bytes,
                   audited: tuple | None = None) -> Awaitable[Reply]:
        """An infer request (unguarded, or one the guard let through; ``audited`` as ``_infer``'s): a future
        of its reply, set from the batch's answer (the data plane's ``infer_then``), so no Task and no
        coroutine per request; where the data plane cannot (the first request, ensembles, sequences,
        fallbacks, another data plane), ``_infer``'s coroutine."""
        if self._loop is None:  # a guarded server's infer requests never pass dispatch, which binds it
            self._bind_loop()
        if self._infer_then is None:
            return self._infer(name, version, headers, body, audited)
        reply = self._loop.create_future()
        # decoded and submitted one loop pass later, where a Task's first step ran: the requests read in one
        # pass reach the batcher together in the next, as its gathering expects (submitted from the read
        # itself, bench_matmul's batches over HTTP c=32 were 18-27 requests against 23-29, CPU 1.05x)
        self._loop.call_soon(self._infer_start, name, version, headers, body, reply, audited)
        return reply

    def _infer_start(self, name: str, version: str, headers: dict[bytes, bytes], body: bytes,
                     reply: asyncio.Future, audited: tuple | None) -> None:
        """Decode and submit; a guarded request's audit line is packed where its reply is set (batch,
        error or general path), by the one ``partial`` every request holds in flight: no done callback
        and no second tracked object per request (each tracked object held in flight doubled a guarded
        server's young-generation collections at c=32: docs/guard.md, stop 28)."""
        try:
            request = _decode(name, version, headers, body, self.max_input_size)
            then = (partial(_encoded, request, reply, response_encoding(headers)) if audited is None else
                    partial(_encoded_audited, self, request, reply, headers, name, version, audited))
            if self._infer_then(request, then) is None:  # type: ignore[misc]
                task = self._loop.create_task(self.dp.infer(request))  # type: ignore[union-attr]
                task.add_done_callback(partial(_task_encoded, then))
        except Exception as exc:  # noqa: BLE001 - every failure becomes an HTTP answer
            if reply.done():  # the answer was given (and audited) before the failure
                raise
            reply.set_result(error_reply(exc))
            if audited is not None:
                self._audit_line(headers, name, version, audited, reply.result())

    def _audit_line(self, headers: dict[bytes, bytes], name: str, version: str, audited: tuple,
                    reply: Reply) -> None:
        end = _perf()  # one read: the latency's end and the line's time
        self.guard.audit.record(headers.get(b"x-request-id") or None, audited[1], audited[2], name, version,
                                "http", reply[0], end - audited[0], audited[3], len(reply[2]), end)

    def _bind_loop(self) -> None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside a loop (a test of the routes): the coroutine path only
            return
        self._infer_then = getattr(self.dp, "infer_then", None)

    async def _unguarded(self, method: bytes, path: str, headers: dict[bytes, bytes], body: bytes) -> Reply:
        try:
            result = self.dispatch(method, path, headers, body)
            if isinstance(result, Awaitable):
                return await result
            return result
        except Exception as exc:  # noqa: BLE001 - every failure becomes an HTTP answer
            return error_reply(exc)

    async def _guarded(self, hit: tuple | None, refused: Exception | None, method: bytes, path: str,
                       headers: dict[bytes, bytes], body: bytes, client: str, start: float) -> Reply:
        """A guarded request other than an infer the guard routed (handle checked it: ``hit``, the guard's
        answer, or ``refused``, its refusal): the route, answers filtered by the key's models, and the
        audit line after it."""
        principal = None
        try:
            if refused is not None:
                raise refused
            principal, _, category, model, version, _ = hit
            if principal.models is None:
                result = self.dispatch(method, path, headers, body)
                reply = await result if isinstance(result, Awaitable) else result
            elif not model and category == "statistics":
                stats = self.dp.model_statistics("", "")
                keep = [s for s in stats.model_stats if principal.may_see(s.name)]
                del stats.model_stats[:]
                stats.model_stats.extend(keep)
                reply = json_reply(codec.message_to_json(stats))
            elif category == "model-repository" and path.rstrip("/").endswith("/index"):
                index = self.dp.repository_index(bool(parse_json_body(body).get("ready", False)))
                keep = [m for m in index.models if principal.may_see(m.name)]
                del index.models[:]
                index.models.extend(keep)
                reply = json_reply(codec.repository_index_json(index))
            else:
                result = self.dispatch(method, path, headers, body)
                reply = await result if isinstance(result, Awaitable) else result
        except Exception as exc:  # noqa: BLE001 - every failure becomes an HTTP answer
            reply = error_reply(exc)
            if principal is None:  # refused by the guard: the route for the audit line
                _, model, version = http_route(path)
        audit = self.guard.audit
        if audit is not None:
            out = reply[2]
            end = _perf()  # one read: the latency's end and the line's time
            audit.record(headers.get(b"x-request-id") or None,
                         principal.key_id if principal is not None else refused_key(refused) if refused else None,
                         client, model, version, "http", reply[0], end - start, len(body),
                         len(out) if type(out) is bytes else 0 if is_stream(out) else len(out), end)
        return reply

    def dispatch(self, method: bytes, path: str, headers: dict[bytes, bytes], body: bytes):
        route = self._infer_routes.get(path)
        if route is not None and method == b"POST":
            return self._infer(route[0], route[1], headers, body)
        parts = [unquote(p) for p in path.split("?", 1)[0].strip("/").split("/")]
        if not parts or parts[0] != "v2":
            raise NotFound(f"no such endpoint: {method.decode()} {path}", fix="KServe v2 paths start with /v2")
        rest = parts[1:]
        get, post = method == b"GET", method == b"POST"
        if not rest:
            self._method(get, method, path)
            return json_reply(codec.server_metadata_json(self.dp.server_metadata()))
        head = rest[0]
        if head == "models":
            return self._models(method, path, rest[1:], headers, body)
        if head == "health" and len(rest) == 2 and rest[1] in ("live", "ready"):
            self._method(get, method, path)
            ok = self.dp.live() if rest[1] == "live" else self.dp.ready()
            return (200 if ok else 400), JSON, b"", ()
        if head == "repository":
            return self._repository(post, method, path, rest[1:], body)
        if head in ("systemsharedmemory", "cudasharedmemory"):
            return self._shared_memory("system" if head[0] == "s" else "cuda", rest[1:], method, path, body)
        if head == "logging" and len(rest) == 1:  # Triton's logging extension (serve/log_settings.py)
            self._method(get or post, method, path)
            if post:
                return json_reply(log_settings.update(parse_json_body(body)).as_dict())
            return json_reply(log_settings.current().as_dict())
        if head == "trace" and rest[1:] == ["setting"]:  # Triton's trace extension (serve/trace.py)
            return self._trace_setting("", method, path, body)
        raise NotFound(f"no such endpoint: {method.decode()} {path}")

    @staticmethod
    def _method(ok: bool, method: bytes, path: str) -> None:
        if not ok:
            raise MethodNotAllowed(f"method {method.decode()} is not allowed on {path}")

    def _models(self, method: bytes, path: str, rest: list[str], headers, body: bytes):
        get, post = method == b"GET", method == b"POST"
        if rest == ["stats"]:
            self._method(get, method, path)
            return json_reply(codec.message_to_json(self.dp.model_statistics("", "")))
        if not rest or not rest[0]:
            raise NotFound(f"no such endpoint: {method.decode()} {path}", fix="name a model: /v2/models/NAME")
        name, version, tail = rest[0], "", rest[1:]
        if len(tail) >= 2 and tail[0] == "versions":
            version, tail = tail[1], tail[2:]
            if not (version.isascii() and version.isdigit()):  # Triton's routes take digits only (no -1, +1)
                raise NotFound(f"no such endpoint: {method.decode()} {path}",
                               fix="name a version by its number: /v2/models/NAME/versions/N")
        if tail == ["trace", "setting"]:
            return self._trace_setting(name, method, path, body)
        action = tail[0] if len(tail) == 1 else ("" if not tail else None)
        if action == "infer":
            self._method(post, method, path)
            if len(self._infer_routes) < _ROUTES_CACHED:
                self._infer_routes[path] = (name, version)
                if self._loop is None:  # once, on the loop (the data plane keeps its first loop too)
                    self._bind_loop()
            return self._infer(name, version, headers, body)
        if action == "":
            self._method(get, method, path)
            return json_reply(codec.model_metadata_json(self.dp.model_metadata(name, version)))
        if action == "ready":
            self._method(get, method, path)
            if self.dp.model_ready(name, version):
                return EMPTY_OK
            return 400, JSON, b'{"error":"Model version not ready"}', ()  # Triton's body
        if action == "config":
            self._method(get, method, path)
            return json_reply(codec.message_to_json(self.dp.model_config(name, version)))
        if action == "stats":
            self._method(get, method, path)
            return json_reply(codec.message_to_json(self.dp.model_statistics(name, version)))
        if action in ("generate", "generate_stream"):
            self._method(post, method, path)
            return self._generate(name, version, body, action == "generate_stream")
        raise NotFound(f"no such endpoint: {method.decode()} {path}")

    def _trace_setting(self, model: str, method: bytes, path: str, body: bytes):
        get, post = method == b"GET", method == b"POST"
        self._method(get or post, method, path)
        return json_reply(self.dp.trace_setting(model, parse_json_body(body) if post else None))

    async def _generate(self, name: str, version: str, body: bytes, stream: bool) -> Reply:
        from azulite.serve import generate  # Triton's generate extension (serve/generate.py)

        if stream:
            return 200, generate.SSE, await generate.generate_stream(self.dp, name, version, body), ()  # type: ignore[return-value]
        return 200, JSON, await generate.generate(self.dp, name, version, body), ()

    async def _infer(self, name: str, version: str, headers: dict[bytes, bytes], body: bytes,
                     audited: tuple | None = None) -> Reply:
        """An infer request's answer, its failure answered here too (error_reply, as every route's): handle
        hands this coroutine straight to the transport. ``audited``: (start, key id, client, bytes in) of a
        guarded request with an audit log, whose line is packed here once answered."""
        response = None
        try:
            request = _decode(name, version, headers, body, self.max_input_size)
            response = await self.dp.infer(request)
            out, hlen = codec.encode_infer_response(response, request)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an HTTP answer
            reply = error_reply(exc)
        else:
            reply = ok_reply(out, hlen, response_encoding(headers))
        if response is not None and response.trace is not None:
            reply = traced_reply(reply, response.trace)
        if audited is not None:
            end = _perf()  # one read: the latency's end and the line's time
            self.guard.audit.record(headers.get(b"x-request-id") or None, audited[1], audited[2], name, version,
                                    "http", reply[0], end - audited[0], audited[3], len(reply[2]), end)
        return reply

    def _repository(self, post: bool, method: bytes, path: str, rest: list[str], body: bytes):
        self._method(post, method, path)
        if rest == ["index"]:
            ready = parse_json_body(body).get("ready", False)
            if not isinstance(ready, bool):
                raise InvalidArgument(f"'ready' must be a JSON boolean, got {json.dumps(ready)}",
                                      fix='e.g. {"ready": true}')
            return json_reply(codec.repository_index_json(self.dp.repository_index(ready)))
        if len(rest) == 3 and rest[0] == "models" and rest[2] in ("load", "unload"):
            return self._load_unload(rest[1], rest[2], parse_json_body(body))
        if len(rest) == 2 and rest[1] == "index":  # a repository's name: ignored for the index, as by Triton
            return self._repository(post, method, path, ["index"], body)
        if len(rest) == 4 and rest[1] == "models" and rest[3] in ("load", "unload"):
            refuse_repository_name(rest[0])
        raise NotFound(f"no such endpoint: {method.decode()} {path}")

    async def _load_unload(self, name: str, action: str, doc: dict[str, Any]) -> Reply:
        params = doc.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidArgument("'parameters' must be a JSON object")
        if action == "unload":
            dependents = params.get("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise InvalidArgument(f"unload parameter 'unload_dependents' must be a JSON boolean, got "
                                      f"{json.dumps(dependents)}", fix='e.g. {"parameters": {"unload_dependents": true}}')
            await self.dp.unload_model(name, dependents)
            return EMPTY_OK
        load_params: dict[str, Any] = {}
        for key, value in params.items():
            if key == "config" and isinstance(value, dict):
                load_params[key] = json.dumps(value)  # an object where Triton wants it as a string: the same
            elif key.startswith("file:"):
                try:  # Triton's HTTP load sends file contents base64-encoded
                    load_params[key] = base64.b64decode(value, validate=True)
                except (ValueError, TypeError):
                    raise InvalidArgument(f"load parameter '{key}' must be base64-encoded file content") from None
            else:
                load_params[key] = value
        await self.dp.load_model(name, load_params or None)
        return EMPTY_OK

    def _shared_memory(self, kind: str, rest: list[str], method: bytes, path: str, body: bytes):
        """Triton's systemsharedmemory and cudasharedmemory routes: [region/NAME/](status|register|unregister)."""
        get, post = method == b"GET", method == b"POST"
        name = ""
        if len(rest) == 3 and rest[0] == "region":
            name, rest = rest[1], rest[2:]
        action = rest[0] if len(rest) == 1 else None
        if action == "status":
            self._method(get, method, path)
            return json_reply(self.dp.shm.status(name, kind))
        if action == "unregister":
            self._method(post, method, path)
            self.dp.shm.unregister(name, kind)
            return EMPTY_OK
        if action == "register" and name:
            self._method(post, method, path)
            doc = parse_json_body(body)
            if kind == "system":
                self.dp.shm.register(name, doc.get("key"), doc.get("offset", 0), doc.get("byte_size"))
            else:
                self.dp.shm.register_cuda(name, cuda_handle(name, doc.get("raw_handle")), doc.get("device_id", 0),
                                          doc.get("byte_size"))
            return EMPTY_OK
        raise NotFound(f"no such endpoint: {method.decode()} {path}",
                       fix=f"use /v2/{kind}sharedmemory[/region/NAME]/status|unregister or .../region/NAME/register")


def cuda_handle(name: str, raw: Any) -> bytes:
    """The CUDA IPC handle of an HTTP register body (``"raw_handle": {"b64": BASE64}``), decoded."""
    text = raw.get("b64") if isinstance(raw, dict) else None
    if not isinstance(text, str):
        raise InvalidArgument(f"CUDA shared memory region '{name}': 'raw_handle' must be {{\"b64\": <base64 of the "
                              f"cudaIpcMemHandle_t>}}, got {raw!r}"[:300],
                              fix="send tritonclient's cuda_shared_memory.get_raw_handle(handle)")
    try:  # not validate=True: Triton's C++ clients (perf_analyzer) send libb64's text, a newline every 72 characters
        return base64.b64decode(text)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"CUDA shared memory region '{name}': raw_handle.b64 is not base64") from None


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
