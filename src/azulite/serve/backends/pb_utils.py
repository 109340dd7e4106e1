"""``triton_python_backend_utils`` as Triton's Python backend ships it: what a ``model.py`` imports as
``pb_utils``. The Python backend installs this module under that name in ``sys.modules`` before it loads
a model, so Triton Python-backend models run unchanged.

Written by hand because the original lives inside Triton's container (no pip package has it); it keeps
Triton's names, signatures and error codes. Tensors hold numpy arrays (BYTES: object arrays of bytes).
Decoupled models (response senders) and custom metrics are not supported and say so.
"""

from __future__ import annotations

import json
import logging
import struct
import sys
import threading
from typing import Any

import numpy as np

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

TRITON_STRING_TO_NUMPY = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}

# TRITONSERVER_DataType values.
_TRITON_TYPE_TO_NUMPY = {
    1: np.bool_, 2: np.uint8, 3: np.uint16, 4: np.uint32, 5: np.uint64, 6: np.int8, 7: np.int16,
    8: np.int32, 9: np.int64, 10: np.float16, 11: np.float32, 12: np.float64, 13: np.object_,
}
_NUMPY_TO_TRITON_TYPE = {np.dtype(v): k for k, v in _TRITON_TYPE_TO_NUMPY.items()}

_local = threading.local()  # the BLS executor of the instance running on this thread

# `import triton_python_backend_utils` in a model.py finds this module (the Python backend imports it
# before any model).
sys.modules.setdefault("triton_python_backend_utils", sys.modules[__name__])


def triton_string_to_numpy(triton_type_string: str):
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int):
    return _TRITON_TYPE_TO_NUMPY[data_type]


def numpy_to_triton_type(data_type) -> int:
    dtype = np.dtype(data_type)
    if dtype.kind in ("S", "U", "O"):
        return 13
    return _NUMPY_TO_TRITON_TYPE[dtype]


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray:
    """Triton's length-prefixed (4-byte little-endian) serialization of a BYTES tensor."""
    if input_tensor.size == 0:
        return np.empty([0], dtype=np.object_)
    chunks = []
    for item in input_tensor.reshape(-1):
        b = item if isinstance(item, bytes) else str(item).encode()
        chunks.append(struct.pack("<I", len(b)) + b)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor) -> np.ndarray:
    data = bytes(encoded_tensor)
    out, offset = [], 0
    while offset < len(data):
        (n,) = struct.unpack_from("<I", data, offset)
        offset += 4
        out.append(data[offset:offset + n])
        offset += n
    return np.array(out, dtype=np.object_)


class TritonError(Exception):
    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, msg: str, code: int = INTERNAL) -> None:
        super().__init__(msg)
        self._msg = msg
        self._code = code

    def message(self) -> str:
        return self._msg

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    def __init__(self, msg: str = "") -> None:
        super().__init__(msg)
        self._msg = msg

    def message(self) -> str:
        return self._msg


class Tensor:
    __slots__ = ("_name", "_array")  # like Triton's (pybind) objects: no ad-hoc attributes, less per call

    def __init__(self, name: str, tensor: Any, *_: Any) -> None:
        if not isinstance(tensor, np.ndarray):
            tensor = np.asarray(tensor)
        if tensor.dtype.kind in ("U", "S"):
            tensor = np.array([s.encode() if isinstance(s, str) else bytes(s) for s in tensor.reshape(-1)],
                              dtype=np.object_).reshape(tensor.shape)
        self._name = name
        self._array = tensor

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        return numpy_to_triton_type(self._array.dtype)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self):
        return self._array.__dlpack__()

    def __dlpack__(self, *args: Any, **kwargs: Any):  # torch.from_dlpack(pb_tensor), as in Triton
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    @staticmethod
    def from_dlpack(name: str, dlpack_tensor) -> "Tensor":
        """From an object with ``__dlpack__`` (a torch tensor, a numpy array) or a raw DLPack capsule."""
        if hasattr(dlpack_tensor, "__dlpack__"):
            return Tensor(name, np.from_dlpack(dlpack_tensor))
        import torch.utils.dlpack

        return Tensor(name, torch.utils.dlpack.from_dlpack(dlpack_tensor).numpy())

    def __repr__(self) -> str:
        return f"Tensor(name={self._name!r}, shape={self.shape()}, dtype={self._array.dtype})"


def _json(parameters: dict | str) -> str:
    """Parameters as Triton's ``parameters()`` gives them: a compact JSON object."""
    return parameters if isinstance(parameters, str) else json.dumps(parameters, separators=(",", ":"))


class InferenceResponse:
    __slots__ = ("_outputs", "_error", "_parameters")

    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None,
                 parameters: dict | str | None = None) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error
        self._parameters = parameters or {}

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return _json(self._parameters)


class InferenceResponseSender:
    """A decoupled request's response sender, as Triton's: ``send(response, flags)`` 0..n times from any
    thread, during or after ``execute``; the last send carries TRITONSERVER_RESPONSE_COMPLETE_FINAL
    (with or without a response). ``deliver(response_or_None, final)`` is the server's side."""

    __slots__ = ("_deliver", "_closed", "_lock")

    def __init__(self, deliver) -> None:
        self._deliver = deliver
        self._closed = False
        self._lock = threading.Lock()

    def send(self, response: "InferenceResponse | None" = None, flags: int = 0) -> None:
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException("send() needs a response, or flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL")
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(f"send() takes a pb_utils.InferenceResponse, got {type(response).__name__}")
        with self._lock:
            if self._closed:
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            self._closed = final
        self._deliver(response, final)

    def is_cancelled(self) -> bool:
        return False


class InferenceTrace:
    """A request's trace, as Triton's Python backend hands it: ``request.trace()``, passed on to a BLS
    request (``InferenceRequest(..., trace=request.trace())``) to trace that call as the request's child
    (serve/trace.py); a BLS request given none is not traced, as in Triton."""

    __slots__ = ("_trace",)

    def __init__(self, trace: Any = None) -> None:
        self._trace = trace  # the server's Trace, or None: the request is not traced

    def get_context(self) -> str | None:
        """The OpenTelemetry context (Triton's opentelemetry trace mode, which azulite does not have): None."""
        return None


_NOT_TRACED = InferenceTrace()


class InferenceRequest:
    """A request handed to ``execute`` — or, built by a model, a BLS request it sends with ``exec()``."""

    __slots__ = ("_model_name", "_requested", "_inputs", "_id", "_correlation_id", "_model_version", "_flags",
                 "_timeout", "_parameters", "_sender", "_trace")

    def __init__(self, model_name: str = "", requested_output_names: list[str] | None = None,
                 inputs: list[Tensor] | None = None, request_id: str = "", correlation_id: int = 0,
                 model_version: int = -1, flags: int = 0, timeout: int = 0, preferred_memory: Any = None,
                 trace: Any = None, parameters: dict | str | None = None) -> None:
        self._model_name = model_name
        self._requested = list(requested_output_names or [])
        self._inputs = list(inputs or [])
        self._id = request_id
        self._correlation_id = correlation_id
        self._model_version = model_version
        self._flags = flags
        self._timeout = timeout
        self._parameters = parameters if parameters is not None else {}
        self._sender: InferenceResponseSender | None = None  # set by the server for decoupled models
        if trace is not None and not isinstance(trace, InferenceTrace):
            raise TritonModelException(f"trace must be a pb_utils.InferenceTrace (request.trace()), got "
                                       f"{type(trace).__name__}")
        self._trace = trace

    def trace(self) -> InferenceTrace:
        return self._trace or _NOT_TRACED

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._requested

    def request_id(self) -> str:
        return self._id

    def correlation_id(self) -> int:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def model_name(self) -> str:
        return self._model_name

    def parameters(self) -> str:
        return _json(self._parameters)

    def is_cancelled(self) -> bool:
        return False

    def get_response_sender(self) -> "InferenceResponseSender":
        sender = self._sender
        if sender is None:
            raise TritonModelException(
                "get_response_sender() is only available to decoupled models (model_transaction_policy "
                "{ decoupled: true }) inside execute()")
        return sender

    def exec(self, decoupled: bool = False) -> InferenceResponse:
        """Business Logic Scripting: run another model of this server, synchronously."""
        if decoupled:
            raise TritonModelException("decoupled BLS requests are not supported by azulite")
        bls = getattr(_local, "bls", None)
        if bls is None:
            raise TritonModelException("BLS exec() is only available inside execute() of a served model")
        return bls(self)

    async def async_exec(self, decoupled: bool = False) -> InferenceResponse:
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(None, self._exec_from, _local.__dict__.get("bls"))

    def _exec_from(self, bls) -> InferenceResponse:
        if bls is None:
            raise TritonModelException("BLS async_exec() is only available inside execute() of a served model")
        return bls(self)


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    for item in model_config.get("input", []):
        if item["name"] == name:
            return item
    return None


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    for item in model_config.get("output", []):
        if item["name"] == name:
            return item
    return None


class ModelConfig:
    """The object ``auto_complete_config`` receives and returns: Triton's methods over the JSON config."""

    def __init__(self, model_config: dict | str) -> None:
        self._config = json.loads(model_config) if isinstance(model_config, str) else model_config

    def as_dict(self) -> dict:
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = self._config.get("max_batch_size", 0)
        if current and current != max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in auto-complete-config function "
                f"for model '{self._config.get('name')}' specified max_batch_size {max_batch_size}")
        self._config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        if not self._config.get("dynamic_batching"):
            self._config["dynamic_batching"] = {}

    def _add(self, kind: str, tensor: dict) -> None:
        for key in ("name", "data_type", "dims"):
            if key not in tensor:
                raise ValueError(f"{kind} '{tensor.get('name')}' in auto-complete-config function for model "
                                 f"'{self._config.get('name')}' is missing '{key}'")
        existing = self._config.setdefault(kind, [])
        for item in existing:
            if item["name"] == tensor["name"]:
                if item.get("data_type") not in (None, "TYPE_INVALID") and item["data_type"] != tensor["data_type"]:
                    raise ValueError(f"unable to override {kind} '{tensor['name']}' data_type {item['data_type']} "
                                     f"with {tensor['data_type']}")
                if item.get("dims") and [int(d) for d in item["dims"]] != [int(d) for d in tensor["dims"]]:
                    raise ValueError(
                        f"unable to override {kind} '{tensor['name']}' dims {item['dims']} with {tensor['dims']}"
                    )
                item.update(tensor)
                return
        existing.append(dict(tensor))

    def add_input(self, input: dict) -> None:  # noqa: A002 (Triton's name)
        self._add("input", input)

    def add_output(self, output: dict) -> None:
        self._add("output", output)

    def set_model_transaction_policy(self, transaction_policy_dict: dict) -> None:
        self._config["model_transaction_policy"] = dict(transaction_policy_dict)

    def add_model_warmup(self, model_warmup: dict) -> None:
        self._config.setdefault("model_warmup", []).append(model_warmup)


class Logger:
    _log = logging.getLogger("azulite.serve.python_model")

    @staticmethod
    def log(msg: str, level: int = 0) -> None:
        Logger._log.info(msg)

    @staticmethod
    def log_info(msg: str) -> None:
        Logger._log.info(msg)

    @staticmethod
    def log_warn(msg: str) -> None:
        Logger._log.warning(msg)

    @staticmethod
    def log_error(msg: str) -> None:
        Logger._log.error(msg)

    @staticmethod
    def log_verbose(msg: str) -> None:
        Logger._log.debug(msg)
