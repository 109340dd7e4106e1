"""KServe v2 infer bodies over HTTP <-> :class:`InferRequest` / :class:`InferResponse`: JSON tensors and
Triton's binary tensor data extension (the protobuf -> JSON rendering of the other answers: serve/http_json.py).

Binary extension (as Triton): the body is a JSON header of ``Inference-Header-Content-Length`` bytes,
then the raw bytes of every input whose ``parameters.binary_data_size`` is set, in input order. Fixed-size
types are little-endian row-major; BYTES elements are each a 4-byte little-endian length and the bytes.
Outputs are answered the same way when the request asks (``binary_data`` per output, or
``binary_data_output`` for all of them).

Written by hand (no library speaks this extension); inputs become numpy views of the request body, no copy.
JSON is read and written with orjson, numeric tensors straight from and to numpy arrays (its
``OPT_SERIALIZE_NUMPY``): 256 FP32 outputs as JSON numbers took 273 us through ``tolist()`` and the
standard library's encoder, 10 us so. A float is written as the shortest text that reads back to the same
value of the tensor's own type (FP32 0.1234 as ``0.1234``, where the float64 route wrote
``0.1234000027179718``): the same FP32 for every client that reads it as FP32, as tritonclient does.
The standard library stays where orjson refuses what the protocol has always taken: non-finite floats
(``NaN``, ``Infinity``: orjson reads them as errors and writes them as ``null``) and integers past 64 bits.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import orjson

from azulite.errors import InvalidArgument
from azulite.serve.config import WIRE_TO_NUMPY
from azulite.serve.json_tensor import json_input, json_text
# the metadata, config, statistics and index answers (serve/http_json.py), where http.py has always found them
from azulite.serve.http_json import (
    message_to_json,
    model_metadata_json,
    NumberTooBig,
    loads as strict_loads,
    repository_index_json,
    server_metadata_json,
)
from azulite.serve.types import InferRequest, InferResponse, InferTensor, RequestedOutput, bytes_element

__all__ = ["decode_infer_request", "deserialize_bytes", "encode_infer_response", "message_to_json",
           "model_metadata_json", "repository_index_json", "serialize_bytes", "server_metadata_json"]

_LEN = struct.Struct("<I")
#: the standard library's json.dumps without its per-call wrapper, for what orjson refuses (module docstring)
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def _loads(data: memoryview | bytes) -> Any:
    """A JSON document (UTF-8) -> Python objects: orjson, else the standard library (``NaN``, ``Infinity``,
    integers past 64 bits), whose error is the one raised when neither reads it."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return strict_loads(data)


# --- BYTES tensors -----------------------------------------------------------------------------------


def deserialize_bytes(buf: memoryview | bytes, count: int, name: str, start: int = 0, end: int | None = None) -> np.ndarray:
    """4-byte length-prefixed elements in ``buf[start:end]`` (default: all of ``buf``) -> an object array of
    ``bytes`` with ``count`` elements. From a ``bytes`` (an HTTP body, a gRPC field) the elements are sliced
    straight off it by offset: no copy of the tensor, no memoryview, first."""
    if end is None:
        end = len(buf)
    if count * 4 > end - start:  # before allocating: a huge shape over a few bytes must cost nothing
        raise InvalidArgument(
            f"input '{name}': binary BYTES data of {end - start} bytes cannot hold the {count} elements its shape needs",
            fix="prefix each element with its 4-byte little-endian length")
    # one or two elements of a buffer that is not bytes: the whole-tensor copy and the list cost more than
    # they save
    out = _split_bytes(buf, count, start, end) if count > 2 or type(buf) is bytes else None
    return out if out is not None else _split_bytes_checked(buf, count, name, start, end)


def _split_bytes(buf: memoryview | bytes, count: int, start: int = 0, end: int | None = None) -> np.ndarray | None:
    """The elements sliced straight off one ``bytes`` (``buf`` itself, else one copy of the tensor), one slice
    per element, no memoryview per element, with no check inside the loop: a length past the end only makes
    its slice short, caught by the total at the end; None when the data is not exactly ``count`` elements,
    and :func:`_split_bytes_checked` names what is wrong. 32 DLRM rows: 10.7 -> 6.3 us of CPU per request,
    256: 80 -> 41 us (copying the tensor first); sliced off the HTTP body itself, see README."""
    if end is None:
        end = len(buf)
    if type(buf) is bytes:
        data, pos = buf, start
    else:
        data, pos, end = bytes(buf[start:end]), 0, end - start
    unpack = _LEN.unpack_from
    if count == 1:  # a one-row request: its element, no list
        try:
            first = pos + 4
            pos = first + unpack(data, pos)[0]
        except struct.error:
            return None
        if pos != end:
            return None
        out = np.empty(1, dtype=np.object_)
        out[0] = data[first:pos]
        return out
    items = [b""] * count
    try:
        for i in range(count):
            first = pos + 4
            pos = first + unpack(data, pos)[0]
            items[i] = data[first:pos]
    except struct.error:  # a length prefix cut off by the end of the buffer
        return None
    if pos != end:  # also a length past the tensor's end, into the next tensor's bytes
        return None
    out = np.empty(count, dtype=np.object_)
    out[:] = items
    return out


def _split_bytes_checked(buf: memoryview | bytes, count: int, name: str, start: int = 0,
                         end: int | None = None) -> np.ndarray:
    """Element by element, each bound checked: the error for data :func:`_split_bytes` refused (and the
    cheaper way for one or two elements of a buffer that is not bytes)."""
    out = np.empty(count, dtype=np.object_)
    view = memoryview(buf)
    pos, end = start, len(view) if end is None else end
    for i in range(count):
        if pos + 4 > end:
            raise InvalidArgument(
                f"input '{name}': binary BYTES data holds fewer than the {count} elements its shape needs",
                fix="prefix each element with its 4-byte little-endian length")
        (n,) = _LEN.unpack_from(view, pos)
        pos += 4
        if pos + n > end:
            raise InvalidArgument(f"input '{name}': BYTES element {i} claims {n} bytes past the end of its data")
        out[i] = bytes(view[pos:pos + n])
        pos += n
    if pos != end:
        raise InvalidArgument(
            f"input '{name}': binary BYTES data has {end - pos} bytes left over after {count} elements",
            fix="binary_data_size must equal the serialized size of exactly the shape's elements")
    return out


def serialize_bytes(array: np.ndarray) -> bytes:
    parts = []
    for item in array.reshape(-1):
        b = item if isinstance(item, bytes) else bytes_element(item)
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


# --- requests ----------------------------------------------------------------------------------------


def _element_count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _shape(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise InvalidArgument(f"input '{name}': 'shape' must be a list of non-negative integers, got {value!r}")
    return tuple(value)


def _dtype(datatype: Any, name: str) -> np.dtype:
    dtype = WIRE_TO_NUMPY.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise InvalidArgument(
            f"input '{name}': unsupported datatype {datatype!r}",
            fix=f"use one of {', '.join(WIRE_TO_NUMPY)}")
    return dtype


#: JSON header bytes -> what decoding them gave, for headers whose every input is binary: a client sends the
#: same header again and again (perf_analyzer, tritonclient with fixed shapes), and parsing and checking it
#: was ~2/3 of an infer body's decode (7.7 -> 2.4 us, 1 KB FP32 input). Bounded: emptied when full, so a
#: client sending endless distinct headers (an id per request) only costs the lookups.
_PLANS: dict[bytes, "_Plan"] = {}
_PLANS_MAX = 256
_PLAN_HEADER_MAX = 4096


class _Plan:
    """A validated header's inputs ``(name, datatype, shape, dtype, count, offset, size, params)`` (offsets
    in the body), the body size they take, and the request's outputs, parameters and id. The dicts are
    copied into each request: nothing downstream shares them."""

    __slots__ = ("inputs", "data_size", "outputs", "parameters", "id")

    def __init__(self, inputs: tuple, data_size: int, outputs: tuple | None, parameters: dict, id: str) -> None:
        self.inputs, self.data_size, self.outputs, self.parameters, self.id = inputs, data_size, outputs, parameters, id

    def request(self, model_name: str, model_version: str, body: bytes) -> InferRequest:
        inputs = []
        for name, datatype, shape, dtype, count, offset, size, params in self.inputs:
            if datatype == "BYTES":  # element lengths are the body's own: checked on every request
                array = deserialize_bytes(body, count, name, offset, offset + size).reshape(shape)
            else:
                array = np.frombuffer(body, dtype, count, offset).reshape(shape)
            inputs.append(InferTensor(name, datatype, shape, array, dict(params) if params else {}))
        outputs = None if self.outputs is None else [RequestedOutput(n, dict(p) if p else {}) for n, p in self.outputs]
        return InferRequest(model_name=model_name, inputs=inputs, model_version=model_version, id=self.id,
                            outputs=outputs, parameters=dict(self.parameters) if self.parameters else {})


def _remember(key: bytes, request: InferRequest, offsets: list[tuple[int, int]], data_size: int) -> None:
    """Keep the plan of a header just decoded whose inputs all came in the binary part (JSON data would make
    every header distinct; shared-memory inputs are read per request by the data plane)."""
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    inputs = []
    for t, (offset, size) in zip(request.inputs, offsets):
        dtype = WIRE_TO_NUMPY[t.datatype]
        inputs.append((t.name, t.datatype, t.shape, dtype, _element_count(t.shape), offset, size,
                       dict(t.parameters)))
    outputs = None if request.outputs is None else tuple((o.name, dict(o.parameters)) for o in request.outputs)
    _PLANS[key] = _Plan(tuple(inputs), data_size, outputs, dict(request.parameters), request.id)


def _flag(value: Any, key: str, owner: str = "") -> None:
    """A JSON boolean (Triton refuses anything else there too: "false" as a string must not read as true)."""
    if type(value) is not bool:
        raise InvalidArgument(f"{owner}parameter '{key}' must be true or false, got {json.dumps(value)}",
                              fix=f'e.g. "{key}": true')


def decode_infer_request(model_name: str, model_version: str, body: bytes, header_length: int | None) -> InferRequest:
    """An HTTP infer body (JSON, or JSON + binary tensors) -> InferRequest. Raises InvalidArgument."""
    key = None
    if (header_length is not None and 0 < header_length <= _PLAN_HEADER_MAX and header_length < len(body)
            and type(body) is bytes):
        key = body[:header_length]
        plan = _PLANS.get(key)
        if plan is not None and plan.data_size == len(body) - header_length:
            return plan.request(model_name, model_version, body)
    view = memoryview(body)
    if header_length is None:
        header_length = len(body)
    elif header_length < 0 or header_length > len(body):
        raise InvalidArgument(
            f"Inference-Header-Content-Length is {header_length} but the body has only {len(body)} bytes")
    try:
        doc = _loads(view[:header_length] if header_length != len(body) else body)
    except NumberTooBig as exc:
        raise InvalidArgument(f"malformed JSON in the infer request: {exc}",
                              fix="send numbers a double holds (up to 1.8e308 either way); write infinity as "
                                  "Infinity") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"malformed JSON in the infer request: {exc}",
                              fix="send a KServe v2 infer request object") from None
    except RecursionError:  # nested thousands deep (orjson refuses past 1024 levels; json recurses)
        raise InvalidArgument("malformed JSON in the infer request: nested deeper than 1024 levels",
                              fix="send a KServe v2 infer request object: tensor data flat or nested by its shape") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("the infer request must be a JSON object")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list):  # empty is fine: a model whose inputs are all optional (as Triton)
        raise InvalidArgument("the infer request needs an 'inputs' array")
    offset = header_length
    inputs: list[InferTensor] = []
    offsets: list[tuple[int, int]] = []  # where each binary input lies in the body (for a plan)
    for i, item in enumerate(raw_inputs):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidArgument(f"inputs[{i}] must be an object with a string 'name'")
        name = item["name"]
        datatype = item.get("datatype")
        dtype = _dtype(datatype, name)
        shape = _shape(item.get("shape"), name)
        params = item.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidArgument(f"input '{name}': 'parameters' must be an object")
        size = params.get("binary_data_size")
        if size is not None:
            if "data" in item:
                raise InvalidArgument(f"input '{name}': has both 'data' and binary_data_size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidArgument(f"input '{name}': binary_data_size must be a non-negative integer, got "
                                      f"{json_text(size)}", fix="the byte count of the input's data after the JSON")
            if offset + size > len(body):
                raise InvalidArgument(
                    f"input '{name}': binary_data_size {size} runs past the end of the body "
                    f"({len(body) - offset} bytes left)",
                    fix="binary_data_size must match the bytes sent after the JSON header")
            count = _element_count(shape)
            if datatype == "BYTES":  # sliced off the body itself, element by element
                array = deserialize_bytes(body, count, name, offset, offset + size).reshape(shape)
                offset += size
            else:
                chunk = view[offset:offset + size]
                offset += size
                expected = count * dtype.itemsize
                if size != expected:
                    raise InvalidArgument(
                        f"input '{name}': binary_data_size is {size} bytes but shape {list(shape)} of "
                        f"{datatype} needs {expected}",
                        fix="send prod(shape) * element size bytes")
                array = np.frombuffer(chunk, dtype=dtype).reshape(shape)
            offsets.append((offset - size, size))
            if not count:
                key = None  # nothing to read: not worth a plan (frombuffer wants a non-empty buffer)
            params = {k: v for k, v in params.items() if k != "binary_data_size"}
        elif "shared_memory_region" in params:  # the data plane reads it from the region (serve/shm.py)
            if "data" in item:
                raise InvalidArgument(f"input '{name}': has both 'data' and shared_memory_region")
            array = None
            key = None
        else:
            key = None
            if "data" not in item:
                raise InvalidArgument(f"input '{name}': needs 'data', parameters.binary_data_size or "
                                      "parameters.shared_memory_region")
            array = json_input(name, datatype, shape, dtype, item["data"])
        inputs.append(InferTensor(name, datatype, shape, array, params))
    if offset != len(body):
        raise InvalidArgument(
            f"the body has {len(body) - offset} bytes after the inputs' binary data",
            fix="binary_data_size of the inputs must add up to the bytes after the JSON header")
    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidArgument("'parameters' must be a JSON object")
    if "binary_data_output" in parameters:
        _flag(parameters["binary_data_output"], "binary_data_output")
    outputs = None
    raw_outputs = doc.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise InvalidArgument("'outputs' must be a JSON array")
        outputs = []
        for i, item in enumerate(raw_outputs):
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise InvalidArgument(f"outputs[{i}] must be an object with a string 'name'")
            oparams = item.get("parameters") or {}
            if not isinstance(oparams, dict):
                raise InvalidArgument(f"output '{item['name']}': 'parameters' must be an object")
            if "binary_data" in oparams:
                _flag(oparams["binary_data"], "binary_data", f"output '{item['name']}': ")
                if oparams["binary_data"] and "shared_memory_region" in oparams:  # Triton's words: one place
                    raise InvalidArgument(f"output '{item['name']}': Output can't set both 'shared_memory_region' "
                                          "and 'binary_data'", fix="drop 'binary_data': the output lands in the region")
            outputs.append(RequestedOutput(item["name"], oparams))
    request_id = doc.get("id", "")
    request = InferRequest(model_name=model_name, inputs=inputs, model_version=model_version,
                           id=request_id if isinstance(request_id, str) else str(request_id),
                           outputs=outputs, parameters=parameters)
    if key is not None:
        _remember(key, request, offsets, len(body) - header_length)
    return request


# --- responses ---------------------------------------------------------------------------------------


def _json_data(t: InferTensor) -> list | np.ndarray:
    """An output's elements for a JSON 'data': BYTES as strings, numbers as a flat C-contiguous array (what
    orjson writes; ``reshape(-1)`` of a strided 1-D view stays strided), copied only when it must be."""
    if t.datatype == "BYTES":
        return [(v if isinstance(v, bytes) else bytes_element(v)).decode("utf-8", "replace") for v in t.data.reshape(-1)]
    return t.data.ravel()


#: (model, version, id, ((output, datatype, shape, bytes), ...)) -> the JSON header of an answer whose every
#: output is binary fixed-size data with no parameters: the same header, byte for byte, as long as those are
#: (4.1 -> 1.9 us for one 1 KB output). Bounded as _PLANS.
_HEADS: dict[tuple, bytes] = {}


def encode_infer_response(response: InferResponse, request: InferRequest) -> tuple[bytes, int | None]:
    """-> (body, json header length or None when the body is JSON only)."""
    binary_default = bool(request.parameters.get("binary_data_output", False)) if request.parameters else False
    wants: dict[str, bool] = {}
    if request.outputs:
        for o in request.outputs:
            wants[o.name] = bool(o.parameters.get("binary_data", binary_default)) if o.parameters else binary_default
    if not response.parameters:
        blobs: list[bytes] = []
        key: list | None = []
        for t in response.outputs:
            if (t.data is None or t.parameters or t.datatype == "BYTES" or type(t.shape) is not tuple
                    or not wants.get(t.name, binary_default)):
                key = None
                break
            blob = t.data.tobytes()  # C order whatever the array's layout
            blobs.append(blob)
            key.append((t.name, t.datatype, t.shape, len(blob)))  # type: ignore[union-attr]
        if key:
            key_t = (response.model_name, response.model_version, response.id, tuple(key))
            header = _HEADS.get(key_t)
            if header is None:
                header = _encode_header(response, request, binary_default, wants)[0]
                if len(_HEADS) >= _PLANS_MAX:
                    _HEADS.clear()
                _HEADS[key_t] = header
            return b"".join([header, *blobs]), len(header)
    header, blobs = _encode_header(response, request, binary_default, wants)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def _encode_header(response: InferResponse, request: InferRequest, binary_default: bool,
                   wants: dict[str, bool]) -> tuple[bytes, list[bytes]]:
    """The JSON header of the answer and the binary data after it, in output order."""
    outputs = []
    blobs: list[bytes] = []
    finite = True  # every float written as JSON data is finite (else the standard library writes them)
    for t in response.outputs:
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        params = dict(t.parameters) if t.parameters else {}
        if t.data is None:  # written into the client's shared memory region: no data here
            pass
        elif wants.get(t.name, binary_default):
            if t.datatype == "BYTES":
                blob = serialize_bytes(t.data)
            else:
                blob = np.ascontiguousarray(t.data).tobytes()
            params["binary_data_size"] = len(blob)
            blobs.append(blob)
        else:
            entry["data"] = data = _json_data(t)
            if finite and type(data) is np.ndarray and data.dtype.kind == "f":
                finite = bool(np.isfinite(data).all())
        if params:
            entry["parameters"] = params
        outputs.append(entry)
    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = outputs
    if finite:
        try:
            return orjson.dumps(doc, option=_NUMPY), blobs
        except orjson.JSONEncodeError:  # an integer past 64 bits in a parameter, an array orjson does not take
            pass
    for entry in outputs:  # NaN / Infinity as Python's json has always written them
        if type(entry.get("data")) is np.ndarray:
            entry["data"] = entry["data"].tolist()
    return _ENCODE(doc).encode(), blobs
