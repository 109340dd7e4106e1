"""The protocol-neutral data plane: what the HTTP and gRPC front-ends call, and the request and
response objects they convert to and from. One data plane holds Triton's semantics; each transport is a
thin adapter (converters + a route table). Errors are :class:`azulite.errors.ServeError` subclasses whose
``status`` each transport maps once to an HTTP status / gRPC code.

Tensors travel as numpy arrays end to end (no per-element Python objects on the hot path); BYTES tensors
are numpy ``object`` arrays of ``bytes``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from azulite.serve.proto import model_config_pb2, service_pb2


def bytes_element(item: Any) -> bytes:
    """One element of a BYTES tensor as bytes: bytes as they are, text as UTF-8, anything else as its text
    (as Triton's serialize_byte_tensor writes a Python model's output: 7 -> b"7", never bytes(7)'s seven
    zero bytes, nor a huge allocation for a huge number)."""
    if type(item) is bytes:
        return item
    if isinstance(item, str):
        return item.encode()
    if isinstance(item, (bytes, bytearray, memoryview)):  # numpy's bytes_ too
        return bytes(item)
    return str(item).encode()


@dataclass(slots=True)
class InferTensor:
    """One input or output tensor. ``datatype`` is the KServe v2 / Triton name ("FP32", "INT64",
    "BYTES", "BOOL", ...); ``data`` is a numpy array of the matching dtype already in ``shape``."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RequestedOutput:
    """An output the client asked for. ``parameters`` may hold ``binary_data`` (transport concern) and
    ``classification`` (int k: the data plane answers the top-k as BYTES "value:index[:label]")."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferRequest:
    """``model_version`` "" means the version policy's default (the highest ready version).
    ``outputs`` None means every output of the model. ``parameters`` carries Triton's request
    parameters: ``priority`` (int), ``timeout`` (microseconds), ``binary_data_output`` ..."""

    model_name: str
    inputs: list[InferTensor]
    model_version: str = ""
    id: str = ""
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    #: the front-end that received it ("HTTP", "GRPC"; "" for none, e.g. an ensemble's step) and when it
    #: began and finished receiving it (CLOCK_MONOTONIC ns): a traced request's first timestamps
    front_end: str = ""
    recv_start: int = 0
    recv_end: int = 0
    #: the W3C trace context (``traceparent``, ``tracestate``) the request carried, or None (serve/otel.py)
    trace_context: dict[str, str] | None = None


@dataclass(slots=True)
class InferResponse:
    model_name: str
    model_version: str
    outputs: list[InferTensor]
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    #: a traced request's trace, its front-end's send still to report (``trace.sent(start_ns, end_ns)``,
    #: serve/trace.py); None for every other
    trace: Any = None


class DataPlane(Protocol):
    """What a front-end may call. Every method raises ``ServeError`` subclasses for failures."""

    def live(self) -> bool: ...

    def ready(self) -> bool: ...

    def server_metadata(self) -> service_pb2.ServerMetadataResponse: ...

    def model_ready(self, name: str, version: str = "") -> bool: ...

    def model_metadata(self, name: str, version: str = "") -> service_pb2.ModelMetadataResponse: ...

    def model_config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig: ...

    def model_statistics(self, name: str = "", version: str = "") -> service_pb2.ModelStatisticsResponse: ...

    def trace_setting(self, model: str = "", changes: dict | None = None) -> dict: ...

    async def infer(self, request: InferRequest) -> InferResponse: ...

    def infer_stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """0..n responses of a decoupled model, or infer's one answer (gRPC ModelStreamInfer)."""
        ...

    def repository_index(self, ready_only: bool = False) -> service_pb2.RepositoryIndexResponse: ...

    async def load_model(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        """``parameters`` as Triton's load API: ``config`` (a JSON ModelConfig override) and
        ``file:<version>/<name>`` entries (bytes) to load from instead of the repository."""
        ...

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None: ...

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking new requests, finish those in flight, finalize every model."""
        ...
