"""Which API category, model and version a request is: Triton's restricted-API categories
(docs/customization_guide/inference_protocols.md), the HTTP path and gRPC method tables that map a request
onto them, and the ``Authorization: Bearer`` parse. serve/auth.py's Guard decides with these; the transports
route with the same answers, so what is checked is what runs.
"""

from __future__ import annotations

from urllib.parse import unquote

from azulite.errors import Unauthenticated

CATEGORIES = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
              "statistics", "trace", "logging")
#: admin-only under --auth even when no flag names them: they load code, or act on the whole server
ADMIN_CATEGORIES = frozenset({"model-repository", "shared-memory", "trace", "logging"})
#: in these categories the guard checks no key (Kubernetes probes); model readiness is not one of them
OPEN = "open"


#: what a transport puts for the credentials of a request that carries two (HTTP headers, gRPC metadata):
#: the last one won over HTTP and the first over gRPC; now neither
TWO_CREDENTIALS = "\x00two"


def bearer(value: str | bytes | None) -> str | None:
    """``Authorization: Bearer <key>`` -> the key (None when absent or another scheme). Two of them
    (:data:`TWO_CREDENTIALS`) are refused: Unauthenticated."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if value == TWO_CREDENTIALS:
        raise Unauthenticated("the request carries more than one Authorization header (gRPC: authorization "
                              "metadata entry)", fix="send exactly one: Authorization: Bearer <key>")
    scheme, _, token = value.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


_ROUTES: dict[str, tuple[str, str, str, bool]] = {}


def http_route(path: str) -> tuple[str, str, str]:
    """An HTTP path -> (category, model, version), as HttpApp.dispatch routes it."""
    return http_route_infer(path)[:3]


def http_route_infer(path: str) -> tuple[str, str, str, bool]:
    """:func:`http_route` and whether the path is exactly an infer route (``/v2/models/NAME[/versions/V]/infer``,
    NAME not empty): the one HttpApp.dispatch answers with an inference, so a guarded POST to it goes
    straight to the model the guard checked. Clients repeat a few paths, so answers are cached (bounded:
    a client inventing paths only refills it)."""
    route = _ROUTES.get(path)
    if route is None:
        if len(_ROUTES) >= 1024:
            _ROUTES.clear()
        route = _ROUTES[path] = _http_route(path)
    return route


def _http_route(path: str) -> tuple[str, str, str, bool]:
    path = path.split("?", 1)[0]
    parts = [unquote(p) for p in path.strip("/").split("/")] if "%" in path else path.strip("/").split("/")
    if not parts or parts[0] != "v2":
        return "metadata", "", "", False
    rest = parts[1:]
    if not rest:
        return "metadata", "", "", False
    head = rest[0]
    if head == "health":
        return (OPEN if len(rest) == 2 and rest[1] in ("live", "ready") else "metadata"), "", "", False
    if head == "models":
        if rest[1:] == ["stats"]:
            return "statistics", "", "", False
        if len(rest) < 2:
            return "metadata", "", "", False
        name, version, tail = rest[1], "", rest[2:]
        if len(tail) >= 2 and tail[0] == "versions":
            version, tail = tail[1], tail[2:]
        action = tail[0] if tail else ""
        category = {"": "metadata", "ready": "health", "config": "model-config", "stats": "statistics",
                    "infer": "inference", "generate": "inference", "generate_stream": "inference",
                    "trace": "trace"}.get(action, "metadata")
        return category, name, version, bool(name) and len(tail) == 1 and action == "infer"
    if head == "repository":
        model = rest[2] if len(rest) >= 3 and rest[1] == "models" else ""
        return "model-repository", model, "", False
    if head in ("systemsharedmemory", "cudasharedmemory"):
        return "shared-memory", "", "", False
    if head in ("logging", "trace"):
        return head, "", "", False
    return "metadata", "", "", False


#: gRPC method -> (category, the request field naming the model)
GRPC_ROUTES: dict[str, tuple[str, str]] = {
    "ServerLive": (OPEN, ""), "ServerReady": (OPEN, ""), "ModelReady": ("health", "name"),
    "ServerMetadata": ("metadata", ""), "ModelMetadata": ("metadata", "name"),
    "ModelInfer": ("inference", "model_name"), "ModelStreamInfer": ("inference", "model_name"),
    "ModelConfig": ("model-config", "name"), "ModelStatistics": ("statistics", "name"),
    "RepositoryIndex": ("model-repository", ""), "RepositoryModelLoad": ("model-repository", "model_name"),
    "RepositoryModelUnload": ("model-repository", "model_name"),
    "SystemSharedMemoryStatus": ("shared-memory", ""), "SystemSharedMemoryRegister": ("shared-memory", ""),
    "SystemSharedMemoryUnregister": ("shared-memory", ""), "CudaSharedMemoryStatus": ("shared-memory", ""),
    "CudaSharedMemoryRegister": ("shared-memory", ""), "CudaSharedMemoryUnregister": ("shared-memory", ""),
    "TraceSetting": ("trace", ""), "LogSettings": ("logging", ""),
}
