"""KServe v2 / Triton over gRPC: tritonclient's own ``GRPCInferenceServiceServicer`` (all 20 RPCs) on
``grpc.aio``, served on the data plane's event loop (no thread hand-off per request; measured faster than
grpcio's thread-pool server here, see bench/serving.py).

Tensors: inputs come as ``raw_input_contents`` (what tritonclient and perf_analyzer send) or as typed
``contents``; outputs always go back as ``raw_output_contents``, as Triton answers. Errors are
:class:`~azulite.errors.ServeError`s mapped once by :data:`GRPC_CODE`; an RPC azulite does not support
answers UNIMPLEMENTED with a message saying what to do instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from azulite.errors import InvalidArgument, ResourceExhausted, ServeError
from azulite.serve import log_settings
from azulite.serve.batcher import Rejected
from azulite.serve.config import WIRE_TO_NUMPY
from azulite.serve.decoupled import FINAL_FLAG
from azulite.serve.http_codec import deserialize_bytes, serialize_bytes
from azulite.serve.otel import traceparent_of
from azulite.serve.proto import service_pb2 as pb
from azulite.serve.proto import service_pb2_grpc
from azulite.serve.repository import refuse_repository_name
from azulite.serve.types import DataPlane, InferRequest, InferResponse, InferTensor, RequestedOutput

log = logging.getLogger("azulite.serve.grpc")

#: ServeError.status -> gRPC status code, the one place it is decided (Triton's grpc status mapping).
GRPC_CODE: dict[str, grpc.StatusCode] = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "UNIMPLEMENTED": grpc.StatusCode.UNIMPLEMENTED,
    "CANCELLED": grpc.StatusCode.CANCELLED,
    "INTERNAL": grpc.StatusCode.INTERNAL,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
}
DEFAULT_MAX_MESSAGE_BYTES = 2**31 - 1  # Triton accepts messages up to INT32_MAX

# InferTensorContents field holding each datatype, for typed (non-raw) inputs.
_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


#: longest grpc-message, in UTF-8 bytes: percent-encoded (up to 3x) it stays well inside grpc's 8 KiB
#: metadata soft limit, over which a client drops the call instead of reading its status
MAX_STATUS_BYTES = 2048


#: the trailing metadata key a refusal says when to come back in (whole seconds), as HTTP's Retry-After
RETRY_AFTER = "retry-after"


def retry_after(exc: BaseException) -> int | None:
    """Seconds a client should wait, for the refusals that have one: a rate limit or quota
    (RESOURCE_EXHAUSTED) and a full bounded queue (UNAVAILABLE; as HTTP's 503, 1 s)."""
    if isinstance(exc, ResourceExhausted):
        return max(1, math.ceil(exc.retry_after_s))
    if isinstance(exc, Rejected) and "queue size" in exc.message:
        return 1
    return None


def _trailers(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a refusal: ``retry-after`` when :func:`retry_after` has one."""
    wait = retry_after(exc)
    return () if wait is None else ((RETRY_AFTER, str(wait)),)


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServeError):
        code, message = GRPC_CODE.get(exc.status, grpc.StatusCode.INTERNAL), str(exc)
        if isinstance(exc, Rejected) and "retry" not in message and (wait := retry_after(exc)):
            message += f" (retry after {wait} s)"  # the message says it too, for clients that drop metadata
    else:
        log.exception("internal error answering an RPC", exc_info=exc)
        code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
    raw = message.encode()
    if len(raw) > MAX_STATUS_BYTES:
        message = raw[:MAX_STATUS_BYTES - 16].decode(errors="ignore") + " ...(truncated)"
    return code, message


def _trace_context(context) -> dict[str, str] | None:
    """The W3C trace context in a call's metadata (serve/otel.py): azulite's transport picked it out of the
    call's headers (grpc_h2_calls._Context), grpcio's context is asked for its metadata."""
    picked = getattr(context, "trace_context", _NOT_PICKED)
    if picked is not _NOT_PICKED:
        return picked
    return traceparent_of(context.invocation_metadata() or ())


_NOT_PICKED = object()


def _param_value(p) -> Any:
    """InferParameter or ModelRepositoryParameter -> its Python value (both name the oneof alike)."""
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def _params_in(params) -> dict[str, Any]:
    # by key, not .items(): protobuf's map has no items of its own, and the abc's ItemsView is a Python
    # generator (two parameters: 1.77 -> 1.34 us)
    return {k: _param_value(params[k]) for k in params} if params else {}


def _params_out(target, params: dict[str, Any]) -> None:
    for k, v in params.items():
        p = target[k]
        if isinstance(v, bool):
            p.bool_param = v
        elif isinstance(v, int):
            p.int64_param = v
        elif isinstance(v, float):
            p.double_param = v
        else:
            p.string_param = str(v)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_raw_count(req: pb.ModelInferRequest) -> None:
    """Raw contents for every input not in shared memory (asked only when their counts differ)."""
    raw = req.raw_input_contents
    in_shm = sum(1 for t in req.inputs if "shared_memory_region" in t.parameters)  # no raw content
    if len(raw) != len(req.inputs) - in_shm:
        raise InvalidArgument(
            f"raw_input_contents has {len(raw)} entries for {len(req.inputs) - in_shm} inputs"
            + (" not in shared memory" if in_shm else ""),
            fix="send raw contents for every input, or typed contents for every input")


def decode_infer_request(req: pb.ModelInferRequest) -> InferRequest:
    """One pass over the inputs, each protobuf field read once (a field read costs ~0.1-0.2 us on upb)."""
    raw = req.raw_input_contents
    n_raw = len(raw)
    raw_index = 0
    req_inputs = req.inputs
    if n_raw and n_raw != len(req_inputs):
        _check_raw_count(req)
    inputs: list[InferTensor] = []
    for t in req_inputs:
        name, datatype = t.name, t.datatype
        dtype = WIRE_TO_NUMPY.get(datatype)
        if dtype is None:
            raise InvalidArgument(f"input '{name}': unsupported datatype {datatype!r}",
                                  fix=f"use one of {', '.join(WIRE_TO_NUMPY)}")
        shape = tuple(t.shape)
        if shape and min(shape) < 0:
            raise InvalidArgument(f"input '{name}': shape {list(shape)} has a negative dimension")
        count = _count(shape)
        tparams = t.parameters
        params = _params_in(tparams) if tparams else {}
        if params and "shared_memory_region" in params:  # the data plane reads it (serve/shm.py)
            inputs.append(InferTensor(name, datatype, shape, None, params))  # type: ignore[arg-type]
            continue
        if n_raw:
            if t.HasField("contents"):  # Triton's words: which of the two to read would be a guess
                raise InvalidArgument(f"contents field must not be specified when using raw_input_contents for "
                                      f"'{name}' for model '{req.model_name}'",
                                      fix="send every input's data in raw_input_contents, or every input's in contents")
            buf = raw[raw_index]
            raw_index += 1
            if datatype == "BYTES":
                array = deserialize_bytes(buf, count, name).reshape(shape)
            else:
                expected = count * dtype.itemsize
                if len(buf) != expected:
                    raise InvalidArgument(
                        f"input '{name}': raw content is {len(buf)} bytes but shape {list(shape)} of "
                        f"{datatype} needs {expected}")
                array = np.frombuffer(buf, dtype=dtype).reshape(shape)
        else:
            field = _CONTENTS_FIELD.get(datatype)
            if field is None:
                raise InvalidArgument(f"input '{name}': {datatype} has no typed contents field",
                                      fix="send it in raw_input_contents")
            values = getattr(t.contents, field)
            if len(values) != count:
                raise InvalidArgument(
                    f"input '{name}': shape {list(shape)} needs {count} elements, contents has {len(values)}")
            if datatype == "BYTES":
                array = np.empty(count, dtype=np.object_)
                array[:] = list(values)
                array = array.reshape(shape)
            else:
                try:
                    array = np.array(values, dtype=dtype).reshape(shape)
                except (OverflowError, ValueError) as exc:
                    raise InvalidArgument(f"input '{name}': contents do not fit {datatype}: {exc}") from None
        inputs.append(InferTensor(name, datatype, shape, array, params))
    if raw_index != n_raw:  # as many raw contents as inputs, one of them in shared memory
        _check_raw_count(req)
    outputs = None
    req_outputs = req.outputs
    if req_outputs:
        outputs = []
        for o in req_outputs:
            oparams = o.parameters
            outputs.append(RequestedOutput(o.name, _params_in(oparams) if oparams else {}))
    rparams = req.parameters
    return InferRequest(model_name=req.model_name, inputs=inputs, model_version=req.model_version, id=req.id,
                        outputs=outputs, parameters=_params_in(rparams) if rparams else {})


def encode_infer_response(resp: InferResponse) -> pb.ModelInferResponse:
    msg = pb.ModelInferResponse(model_name=resp.model_name, model_version=resp.model_version, id=resp.id)
    if resp.parameters:
        _params_out(msg.parameters, resp.parameters)
    raw = msg.raw_output_contents
    for t in resp.outputs:
        out = msg.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        if t.parameters:
            _params_out(out.parameters, t.parameters)
        if t.data is None:  # written into the client's shared memory region: as Triton, an empty entry
            raw.append(b"")
            continue
        raw.append(serialize_bytes(t.data) if t.datatype == "BYTES" else np.ascontiguousarray(t.data).tobytes())
    return msg


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The GRPCInferenceService over a DataPlane. Each RPC converts, calls, converts back; failures go
    through :func:`_status` only."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dp = dataplane
        self.in_flight = 0

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException):
        code, message = _status(exc)
        await context.abort(code, message, _trailers(exc))

    # --- health and metadata ------------------------------------------------------------------------

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self.dp.live())

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.dp.ready())

    async def ModelReady(self, request, context):
        try:
            return pb.ModelReadyResponse(ready=self.dp.model_ready(request.name, request.version))
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc)

    async def ServerMetadata(self, request, context):
        try:
            return self.dp.server_metadata()
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc)

    async def ModelMetadata(self, request, context):
        try:
            return self.dp.model_metadata(request.name, request.version)
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc)

    async def ModelConfig(self, request, context):
        try:
            return pb.ModelConfigResponse(config=self.dp.model_config(request.name, request.version))
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc)

    async def ModelStatistics(self, request, context):
        try:
            return self.dp.model_statistics(request.name, request.version)
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc)

    # --- inference ----------------------------------------------------------------------------------

    async def ModelInfer(self, request, context):
        self.in_flight += 1
        response = None
        try:
            infer = decode_infer_request(request)
            start = getattr(context, "recv_start", 0)  # azulite's transport's receive times (grpc_h2_calls)
            if start:
                infer.front_end, infer.recv_start, infer.recv_end = "GRPC", start, context.recv_end
            infer.trace_context = _trace_context(context)
            response = await self.dp.infer(infer)
            answer = encode_infer_response(response)
            if response.trace is not None:  # the transport reports its send (serve/trace.py)
                context.trace = response.trace
            return answer
        except Exception as exc:  # noqa: BLE001
            if response is not None and response.trace is not None:
                response.trace.sent(0, 0)
            await self._abort(context, exc)
        finally:
            self.in_flight -= 1

    async def _stream_one(self, request, queue: asyncio.Queue, trace_context: dict | None = None) -> None:
        """Puts the request's responses on the stream's queue: one, or 0..n from a decoupled model."""
        try:
            infer = decode_infer_request(request)
            infer.trace_context = trace_context
            async for response in self.dp.infer_stream(infer):
                queue.put_nowait(pb.ModelStreamInferResponse(infer_response=encode_infer_response(response)))
        except Exception as exc:  # noqa: BLE001 - a stream reports errors per response, as Triton
            _, message = _status(exc)
            error = pb.ModelInferResponse(id=request.id, model_name=request.model_name)  # as Triton's, marked final
            error.parameters[FINAL_FLAG].bool_param = True
            queue.put_nowait(pb.ModelStreamInferResponse(error_message=message, infer_response=error))

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests of a stream run concurrently; each response is sent when ready (match them by id). A
        broken request stream ends the call with its error status, after the responses already due."""
        queue: asyncio.Queue = asyncio.Queue()
        read_done, request_done = object(), object()
        pending = 0
        done_reading = False
        trace_context = _trace_context(context)  # the call's, for each of its requests

        def finished(task: asyncio.Task) -> None:
            self.in_flight -= 1  # here, not in the coroutine: a task canceled before it ran counts too
            queue.put_nowait(request_done)  # this request's responses are all on the queue

        async def reader():
            nonlocal pending, done_reading
            try:
                async for request in request_iterator:
                    pending += 1
                    self.in_flight += 1
                    asyncio.ensure_future(self._stream_one(request, queue, trace_context)).add_done_callback(finished)
            finally:
                done_reading = True
                queue.put_nowait(read_done)

        read_task = asyncio.ensure_future(reader())
        try:
            while not (done_reading and pending == 0):
                item = await queue.get()
                if item is read_done:
                    continue
                if item is request_done:
                    pending -= 1
                else:
                    yield item
            exc = None if read_task.cancelled() else read_task.exception()
            if isinstance(exc, DecodeError):  # grpc.aio's request iterator, on a message it cannot parse
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse a request message: {exc}")
            if exc is not None:  # the transport's own error keeps its status
                raise exc
        finally:
            read_task.cancel()

    # --- repository ---------------------------------------------------------------------------------

    async def RepositoryIndex(self, request, context):
        try:
            refuse_repository_name(request.repository_name)  # over gRPC Triton refuses it for the index too
            return self.dp.repository_index(request.ready)
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc)

    async def RepositoryModelLoad(self, request, context):
        try:
            refuse_repository_name(request.repository_name)
            params = {}
            for key, value in request.parameters.items():
                want = "string_param" if key == "config" else "bytes_param" if key.startswith("file:") else None
                if want and value.WhichOneof("parameter_choice") != want:  # Triton's words
                    raise InvalidArgument(f"invalid value type for load parameter '{key}', expected {want}.")
                params[key] = _param_value(value)
            await self.dp.load_model(request.model_name, params or None)
            return pb.RepositoryModelLoadResponse()
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc)

    async def RepositoryModelUnload(self, request, context):
        try:
            refuse_repository_name(request.repository_name)
            p = request.parameters.get("unload_dependents")
            if p is not None and p.WhichOneof("parameter_choice") != "bool_param":  # Triton's words
                raise InvalidArgument("invalid value type for 'unload_dependents' parameter, expected bool_param.")
            await self.dp.unload_model(request.model_name, p.bool_param if p is not None else False)
            return pb.RepositoryModelUnloadResponse()
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc)

    # --- system shared memory (serve/shm.py) -------------------------------------------------------

    async def _shm_status(self, context, name: str, kind: str, answer):
        """Either kind's status RPC: ``answer`` its response class (with its RegionStatus)."""
        try:
            response = answer()
            for r in self.dp.shm.status(name, kind):
                response.regions[r["name"]].CopyFrom(answer.RegionStatus(**r))
            return response
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc)

    async def SystemSharedMemoryStatus(self, request, context):
        return await self._shm_status(context, request.name, "system", pb.SystemSharedMemoryStatusResponse)

    async def SystemSharedMemoryRegister(self, request, context):
        try:
            self.dp.shm.register(request.name, request.key, request.offset, request.byte_size)
            return pb.SystemSharedMemoryRegisterResponse()
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc)

    async def SystemSharedMemoryUnregister(self, request, context):
        self.dp.shm.unregister(request.name, "system")
        return pb.SystemSharedMemoryUnregisterResponse()

    # --- CUDA shared memory (serve/cuda_shm.py) ------------------------------------------------------

    async def CudaSharedMemoryStatus(self, request, context):
        return await self._shm_status(context, request.name, "cuda", pb.CudaSharedMemoryStatusResponse)

    async def CudaSharedMemoryRegister(self, request, context):
        try:
            self.dp.shm.register_cuda(request.name, request.raw_handle, request.device_id, request.byte_size)
            return pb.CudaSharedMemoryRegisterResponse()
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc)

    async def CudaSharedMemoryUnregister(self, request, context):
        self.dp.shm.unregister(request.name, "cuda")
        return pb.CudaSharedMemoryUnregisterResponse()

    async def TraceSetting(self, request, context):
        """Triton's trace extension (serve/trace.py): an empty request reads the settings; an empty value
        list clears a model's own setting."""
        try:
            changes = {key: (None if not value.value else list(value.value) if key == "trace_level"
                             else value.value[0]) for key, value in request.settings.items()}
            answer = self.dp.trace_setting(request.model_name, changes or None)
            response = pb.TraceSettingResponse()
            for key, value in answer.items():
                response.settings[key].value.extend(value if isinstance(value, list) else [value])
            return response
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc)

    async def LogSettings(self, request, context):
        """Triton's logging extension (serve/log_settings.py): an empty request reads the settings."""
        try:
            changes = {key: _param_value(value) for key, value in request.settings.items()}
            settings = log_settings.update(changes) if changes else log_settings.current()
            response = pb.LogSettingsResponse()
            for key, value in settings.as_dict().items():
                field = ("bool_param" if isinstance(value, bool) else
                         "uint32_param" if isinstance(value, int) else "string_param")
                setattr(response.settings[key], field, value)
            return response
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc)


class GrpcServer:
    """grpc.aio server for one InferenceServicer, on the running loop."""

    reuse_port = False  # SO_REUSEPORT: the front-ends of a multi-worker server share the port

    def __init__(self, dataplane: DataPlane, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 guard=None, limits=None) -> None:
        """``limits``: a ConnectionLimits whose message, stream and header limits grpc.aio enforces (its
        other defences are its own; serve/limits.py's H2_ONLY ones it has no option for)."""
        self.servicer = InferenceServicer(dataplane)
        if guard is not None:
            from azulite.serve.grpc_guard import GuardedServicer

            self.servicer = GuardedServicer(self.servicer, guard)
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        if limits is not None:
            options[:2] = [("grpc.max_receive_message_length", limits.max_message_bytes),
                           ("grpc.max_send_message_length", max_message_bytes)]
            options += [("grpc.max_concurrent_streams", limits.max_streams),
                        ("grpc.max_metadata_size", limits.max_header_bytes)]
        self._server = grpc.aio.server(options=options)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, self._server)

    async def start(self, host: str, port: int) -> int:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bound = self._server.add_insecure_port(address)
        if bound == 0:
            raise OSError(f"gRPC cannot bind {address}")
        await self._server.start()
        return bound

    async def drain(self, timeout_s: float) -> None:
        """Refuse new RPCs, let the in-flight ones finish (up to timeout_s), then close."""
        await self._server.stop(grace=timeout_s)
