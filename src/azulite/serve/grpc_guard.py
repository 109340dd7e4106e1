"""The :class:`~azulite.serve.auth.Guard` in front of the gRPC servicer: every one of the 20 RPCs is
checked (key from the ``authorization`` metadata, restricted-API metadata, the model the request names,
limits) before the real servicer runs, and audited after. One wrapper serves both transports: azulite's
HTTP/2 server and grpc.aio call the RPCs by attribute name alike.
"""

from __future__ import annotations

import time
from time import perf_counter as _perf

from azulite.errors import ServeError
from azulite.serve.api_routes import GRPC_ROUTES, TWO_CREDENTIALS
from azulite.serve.auth import Guard, Principal, refused_key
from azulite.serve.grpc import _status, _trailers
from azulite.serve.proto import service_pb2 as pb

_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]


def _metadata(context, name: str) -> str | None:
    """One metadata value from either transport (h2: raw (bytes, bytes) headers; grpc.aio: str keys).
    HTTP/2 header names are lower case (RFC 9113 8.2.1: a request with an upper-case one is malformed;
    grpc.aio hands them over lower-cased), so a key compares as it is: no decode, no lower() per
    header of every request. A name sent in upper case is therefore not found: refused, never let through."""
    raw = name.encode("latin-1")
    for key, value in context.invocation_metadata() or ():
        if key == raw or key == name:
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return None


def _authorization(context) -> str | None:
    """``_metadata(context, "authorization")``, the one every guarded call asks for; two entries are
    TWO_CREDENTIALS (refused: the first one was taken, where HTTP took the last)."""
    found = None
    for key, value in context.invocation_metadata() or ():
        if key == b"authorization" or key == "authorization":
            if found is not None:
                return TWO_CREDENTIALS
            found = value.decode("latin-1") if isinstance(value, bytes) else value
    return found


def _code_of(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if callable(code):  # grpc.aio's AbortError carries no code; the context does
        return "ERROR"
    return getattr(code, "name", None) or type(exc).__name__


#: request message type -> (its model field, its version field, whether it has an id), read from its
#: descriptor once: asking a message for a field it lacks (getattr with a default) raises and catches an
#: AttributeError inside protobuf, measured at several µs a request
_FIELDS: dict[type, tuple[str, str, bool]] = {}


def _fields_of(request) -> tuple[str, str, bool]:
    names = request.DESCRIPTOR.fields_by_name
    model = "model_name" if "model_name" in names else "name" if "name" in names else ""
    version = "model_version" if "model_version" in names else "version" if "version" in names else ""
    fields = _FIELDS[type(request)] = (model, version, "id" in names)
    return fields


#: context type -> whether it carries the call's sizes (azulite's HTTP/2 transport; grpc.aio's does not)
_SIZED: dict[type, bool] = {}


def _sizes(context, request, response) -> tuple[int, int]:
    """The request's and the answer's sizes for the audit line. On azulite's HTTP/2 transport the request's
    comes from the call, and the answer is serialized once here and handed to the transport to send
    (``context.reply_payload``): ``ByteSize`` would serialize it a second time; on grpc.aio, ByteSize."""
    kind = type(context)
    sized = _SIZED.get(kind)
    if sized is None:
        sized = _SIZED[kind] = bool(getattr(kind, "sizes_known", False))
    n_in = context.request_bytes if sized else None
    if n_in is None:
        return request.ByteSize(), (response.ByteSize() if response is not None else 0)
    if response is None:
        return n_in, 0
    context.reply_payload = payload = response.SerializeToString()
    return n_in, len(payload)


#: the RPCs whose answer lists models: a key limited to some models sees only those (``_filtered``)
_FILTERED = frozenset(("ModelStatistics", "RepositoryIndex"))


class GuardedServicer:
    """Has the same RPC attributes as the servicer it wraps."""

    def __init__(self, inner, guard: Guard) -> None:
        self.inner = inner
        self.guard = guard
        #: RPC name -> (the real servicer's method, enter, leave): the unary RPCs azulite's HTTP/2 transport
        #: guards in its own call (grpc_h2_calls._methods); the two that filter their answer by the key's
        #: models keep the wrapper there too
        self.folded: dict[str, tuple] = {}
        for name, (category, field) in GRPC_ROUTES.items():
            method = getattr(inner, name)
            if name == "ModelStreamInfer":
                setattr(self, name, self._stream(method))
                continue
            parts = self.unary_parts(name, category, field)
            setattr(self, name, self._unary(name, method, parts))
            if name not in _FILTERED:
                self.folded[name] = (method, *parts)

    def _check(self, category: str, model: str, context) -> Principal:
        guard = self.guard
        return guard.check_request("grpc", category, model, _authorization(context) if guard.auth else None,
                                   context, _metadata)

    def _audit(self, start: float, principal: Principal | str | None, request, context, status: str) -> None:
        """The audit line of one request of a stream (the unary RPCs': ``unary_parts``); ``principal``: the
        caller's, or the key id a refusal was for."""
        audit = self.guard.audit
        if audit is None:
            return
        fields = _FIELDS.get(type(request)) or _fields_of(request)
        n_in, n_out = _sizes(context, request, None)
        audit.record((getattr(request, "id") or None) if fields[2] else None,
                     principal if principal is None or isinstance(principal, str) else principal.key_id, context.peer(),
                     getattr(request, fields[0]) if fields[0] else "",
                     getattr(request, fields[1]) if fields[1] else "", "grpc", status, time.perf_counter() - start,
                     n_in, n_out)

    def _unary(self, name: str, method, parts: tuple):
        """The wrapper grpc.aio calls (and azulite's HTTP/2 transport, for the two RPCs that list models),
        built on the same check and audit the HTTP/2 transport calls itself (:meth:`unary_parts`)."""
        enter, leave = parts
        lists_models = name in _FILTERED

        async def call(request, context):
            try:
                state = enter(request, context)
            except ServeError as exc:  # refused, and already audited
                await context.abort(*_status(exc), _trailers(exc))
            response = failure = None
            try:
                principal = state[1]
                if lists_models and principal.models is not None and not state[2]:
                    response = await self._filtered(name, method, request, context, principal)
                else:
                    response = await method(request, context)
                return response
            except BaseException as exc:
                failure = exc
                raise
            finally:
                leave(state, request, context, response, failure)

        call.__name__ = name
        return call

    def unary_parts(self, name: str, category: str, field: str):
        """One unary RPC's guard as two plain functions, so that azulite's HTTP/2 transport runs the
        check and the audit in its own call's frame (grpc_h2_calls.py ``_run_unary``) around the real
        servicer's method, with no guarded coroutine of its own (one coroutine less per call, and one
        level less on each resume of the call). ``enter(request, context)`` -> state: checks the key,
        the restricted-API metadata, the model the request names and the limits; a refusal is audited
        and raised (ServeError: the transport answers it with the protocol's status and trailers).
        ``leave(state, request, context, response, exc)``: the audit line (status OK, or ``exc``'s); ``request``
        may be None for an RPC whose model the guard checks, on a context that knows the call's sizes."""
        # what every call of this RPC asks, looked up once (this runs on every gRPC request): the request
        # type's model / version / id fields from the service's descriptor, the audit log
        check, auth, audit_log = self.guard.check_request, self.guard.auth, self.guard.audit
        model_field, version_field, has_id = _fields_of(getattr(pb, _SERVICE.methods_by_name[name].input_type.name)())
        audit_model_field = "" if field else model_field  # a model the guard does not check is still audited
        record = audit_log.record if audit_log is not None else None

        def enter(request, context) -> tuple:
            start = _perf()
            model = getattr(request, field) if field else ""
            try:
                principal = check("grpc", category, model, _authorization(context) if auth else None,
                                  context, _metadata)
            except ServeError as exc:
                if record is not None:
                    audit(start, refused_key(exc), model, request, context, None, exc.status)
                raise
            if record is None:
                return start, principal, model
            # what the audit line needs of the request, read now: the transport need not keep the request
            # message (a tracked object) for the line (grpc_h2_calls._infer_now)
            return (start, principal, model, (request.id or None) if has_id else None,
                    getattr(request, version_field) if version_field else "")

        def leave(state: tuple, request, context, response, exc: BaseException | None) -> None:
            if record is not None:  # audit()'s body, inlined: one frame less on every call
                principal = state[1]
                n_in, n_out = _sizes(context, request, response)
                record(state[3], principal.key_id if principal is not None else None, context.peer(),
                       getattr(request, audit_model_field) if audit_model_field else state[2], state[4], "grpc",
                       "OK" if exc is None else _code_of(exc), _perf() - state[0], n_in, n_out)

        def audit(start: float, key_id: str | None, model: str, request, context, response, status: str) -> None:
            if audit_model_field:
                model = getattr(request, audit_model_field)
            n_in, n_out = _sizes(context, request, response)
            record((request.id or None) if has_id else None, key_id,
                   context.peer(), model, getattr(request, version_field) if version_field else "", "grpc",
                   status, _perf() - start, n_in, n_out)

        return enter, leave

    async def _filtered(self, name: str, method, request, context, principal: Principal):
        """The RPCs that list every model answer only the key's models."""
        response = await method(request, context)
        if name == "ModelStatistics" and response is not None:
            keep = [s for s in response.model_stats if principal.may_see(s.name)]
            del response.model_stats[:]
            response.model_stats.extend(keep)
        elif name == "RepositoryIndex" and response is not None:
            keep = [m for m in response.models if principal.may_see(m.name)]
            del response.models[:]
            response.models.extend(keep)
        return response

    def _stream(self, method):
        async def call(request_iterator, context):
            start = time.perf_counter()
            try:
                # the key itself, once per stream; its requests are each checked and counted below
                principal = self.guard.check("grpc", "inference", "", self.guard.token(_authorization(context)),
                                             context, _metadata, limits=False)
            except ServeError as exc:
                self._audit(start, refused_key(exc), pb.ModelInferRequest(), context, exc.status)
                await context.abort(*_status(exc), _trailers(exc))
                return

            authorization = _authorization(context) if self.guard.auth else None

            async def checked():
                async for request in request_iterator:
                    t0 = time.perf_counter()
                    try:  # per request: the model it names, and the limits
                        self.guard.check_request("grpc", "inference", request.model_name, authorization, context,
                                                 _metadata)
                    except ServeError as exc:
                        self._audit(t0, principal, request, context, exc.status)
                        raise
                    self._audit(t0, principal, request, context, "OK")
                    yield request

            try:
                async for response in method(checked(), context):
                    yield response
            except ServeError as exc:
                await context.abort(*_status(exc), _trailers(exc))

        call.__name__ = "ModelStreamInfer"
        return call
