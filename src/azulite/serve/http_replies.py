"""The vocabulary of serve/http.py's answers, shared with its transport (serve/http_server.py): a reply
``(status, content type, body, headers)``, Triton's error statuses and JSON (:func:`error_reply`), the
infer answer's 200 (JSON, or binary tensors after a JSON header), a traced request's reply, and the
request-body helpers (JSON object bodies, Content-Encoding)."""

from __future__ import annotations

import json
import logging
import zlib
from typing import Any

from azulite.errors import InvalidArgument, PayloadTooLarge, ServeError
from azulite.serve.http_json import loads as loads_json
from azulite.serve.inflate import inflate
from azulite.serve.trace import TracedReply

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
REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden", 404: b"Not Found", 405: b"Method Not Allowed", 409: b"Conflict",
            408: b"Request Timeout", 413: b"Payload Too Large", 429: b"Too Many Requests", 431: b"Request Header Fields Too Large", 500: b"Internal Server Error", 501: b"Not Implemented",
            503: b"Service Unavailable"}
JSON = b"application/json"
NESTING_LIMIT = 1024  # orjson's: deeper JSON falls to the standard library, which recurses until it fails
DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024  # Triton's --http-max-input-size default
Reply = tuple[int, bytes, bytes, tuple[tuple[bytes, bytes], ...]]  # status, content type, body, headers


class Stop(Exception):
    """Raised from a parser callback: stop parsing this connection's input."""


class MethodNotAllowed(InvalidArgument):
    """An HTTP-only answer (405, as Triton): the path exists, not with this method."""


OCTETS = b"application/octet-stream"
HLEN = b"Inference-Header-Content-Length"


def ok_reply(out, hlen: int | None, encoding: bytes | None = None) -> Reply:
    """An infer request's 200: JSON, or binary tensors after a JSON header of ``hlen`` bytes; compressed
    with ``encoding`` (b"gzip" / b"deflate", from :func:`response_encoding`): ``hlen`` stays the length of
    the header as it is once inflated, as Triton sends it and tritonclient reads it."""
    headers: tuple[tuple[bytes, bytes], ...] = () if hlen is None else ((HLEN, b"%d" % hlen),)
    if encoding is not None:
        if encoding == b"gzip":
            out = zlib.compress(out, 6, 31)  # the gzip wrapper, no file name or time
        else:  # HTTP's "deflate" is the zlib format (RFC 9110), which tritonclient inflates
            out = zlib.compress(out, 6)
        headers = (*headers, (b"Content-Encoding", encoding))
    return 200, (JSON if hlen is None else OCTETS), out, headers


def response_encoding(headers: dict[bytes, bytes]) -> bytes | None:
    """The compression an infer response takes from the request's Accept-Encoding (tritonclient's
    ``response_compression_algorithm``), as Triton offers it: gzip or deflate, the client's first choice
    that is not refused (``;q=0``); None for none (most requests: one dict lookup)."""
    accept = headers.get(b"accept-encoding")
    if accept is None:
        return None
    for item in accept.lower().split(b","):
        name, _, params = item.partition(b";")
        name, params = name.strip(), params.replace(b" ", b"")
        if name in (b"gzip", b"deflate") and params not in (b"q=0", b"q=0.0", b"q=0.00", b"q=0.000"):
            return name
    return None


def traced_reply(reply: Reply, trace: Any) -> TracedReply:
    """The reply to a traced request: the transport reports its send to ``trace`` (serve/trace.py)."""
    traced = TracedReply(reply)
    traced.trace = trace
    return traced


def error_reply(exc: BaseException) -> Reply:
    """Any exception -> Triton's error JSON. Client mistakes are ServeErrors with a 4xx status; anything
    else is the server's fault (500) and is logged with its traceback."""
    if isinstance(exc, MethodNotAllowed):
        return 405, JSON, json.dumps({"error": str(exc)}).encode(), ()
    if isinstance(exc, PayloadTooLarge):  # RESOURCE_EXHAUSTED over gRPC, but no 429: retrying cannot help
        return 413, JSON, json.dumps({"error": str(exc)}).encode(), ()
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


def json_reply(doc: Any, status: int = 200) -> Reply:
    return status, JSON, json.dumps(doc, separators=(",", ":")).encode(), ()


EMPTY_OK: Reply = (200, JSON, b"", ())


def parse_json_body(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        doc = loads_json(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"malformed JSON body: {exc}") from None
    except RecursionError:  # arrays or objects nested thousands deep: no request of the protocol is
        raise InvalidArgument(f"malformed JSON body: nested deeper than {NESTING_LIMIT} levels") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return doc


def decompress(body: bytes, encoding: bytes | None, limit: int = DEFAULT_MAX_INPUT_SIZE) -> bytes:
    """The body as sent, inflated (gzip, deflate) up to ``limit`` bytes (--http-max-input-size)."""
    if not encoding or encoding in (b"identity",):
        return body
    return inflate(body, encoding, limit, flag="--http-max-input-size")
