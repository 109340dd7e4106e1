"""Triton's HTTP generate extension: ``POST v2/models/NAME[/versions/V]/generate`` answers one JSON
object, ``.../generate_stream`` answers server-sent events (one ``data:`` event per response, as a
decoupled model sends them).

The request is one flat JSON object: each member but ``id`` and ``parameters`` is a model input of that
name (a scalar or an array, shaped by the input's dims from the model config, with a batch of 1 when the
model batches); ``parameters`` become the request's parameters. Each answer is ``model_name``,
``model_version`` and one member per output (a single element as a scalar, BYTES as text).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from azulite.errors import InvalidArgument, ServeError
from azulite.serve import config as cfg
from azulite.serve.http_json import loads as loads_json
from azulite.serve.types import InferRequest, InferResponse, InferTensor

SSE = b"text/event-stream; charset=utf-8"


def _flat(value: Any) -> list:
    if isinstance(value, list):
        out: list = []
        for v in value:
            out += _flat(v)
        return out
    return [value]


def request_from_json(dp, name: str, version: str, body: bytes) -> InferRequest:
    try:
        doc = loads_json(body or b"{}")
    except ValueError as exc:
        raise InvalidArgument(f"generate request for model '{name}' is not JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument(f"generate request for model '{name}' is nested too deep to be one") from None
    if not isinstance(doc, dict):
        raise InvalidArgument(f"generate request for model '{name}' must be a JSON object")
    config = dp.model_config(name, version)  # NotFound / Unavailable for an unknown model
    specs = {i.name: i for i in config.input}
    parameters = doc.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"generate request for model '{name}': 'parameters' must be a JSON object")
    inputs = []
    for key, value in doc.items():
        if key in ("id", "parameters"):
            continue
        spec = specs.get(key)
        if spec is None:
            raise InvalidArgument(f"generate request for model '{name}': '{key}' is not an input of the model",
                                  fix=f"the model's inputs are {sorted(specs)}")
        datatype = cfg.wire_datatype(spec.data_type)
        values = _flat(value)
        dims = list(spec.dims)
        known = int(np.prod([d for d in dims if d >= 0])) if dims else 1
        if dims.count(-1) == 1 and known and len(values) % known == 0:
            dims[dims.index(-1)] = len(values) // known
        elif dims.count(-1) > 1:
            dims = [len(values)] if len(dims) == 1 else [1] * (len(dims) - 1) + [len(values)]
        shape = tuple(([1] if config.max_batch_size > 0 else []) + dims)
        if int(np.prod(shape)) != len(values):
            raise InvalidArgument(f"generate request for model '{name}': input '{key}' has {len(values)} "
                                  f"element(s), its dims {list(spec.dims)} need {int(np.prod(shape))}")
        try:
            if datatype == "BYTES":
                data = np.array([v.encode() if isinstance(v, str) else json.dumps(v).encode() for v in values],
                                dtype=np.object_).reshape(shape)
            else:
                data = np.array(values, dtype=cfg.WIRE_TO_NUMPY[datatype]).reshape(shape)
        except (TypeError, ValueError, KeyError) as exc:
            raise InvalidArgument(f"generate request for model '{name}': input '{key}' is not {datatype}: {exc}")
        inputs.append(InferTensor(key, datatype, shape, data))
    return InferRequest(model_name=name, model_version=version, inputs=inputs, id=str(doc.get("id", "")),
                        parameters=parameters)


def response_json(response: InferResponse) -> bytes:
    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    for t in response.outputs:
        data = t.data
        if data is None:
            continue
        if data.dtype == np.object_:
            items = [v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)
                     for v in data.reshape(-1)]
        else:
            items = data.reshape(-1).tolist()
        doc[t.name] = items[0] if len(items) == 1 else items
    return json.dumps(doc).encode()


async def generate(dp, name: str, version: str, body: bytes) -> bytes:
    """One answer: a decoupled model must send exactly one response."""
    request = request_from_json(dp, name, version, body)
    answers = [r async for r in dp.infer_stream(request)]
    if len(answers) != 1:
        raise InvalidArgument(f"model '{name}' sent {len(answers)} responses; /generate answers exactly one",
                              fix="use /generate_stream for a model that sends several")
    return response_json(answers[0])


async def generate_stream(dp, name: str, version: str, body: bytes) -> AsyncIterator[bytes]:
    """Validates before the first byte (so a bad request is a plain 4xx), then yields SSE events; an
    error after the stream started is an ``error`` event, as Triton sends it."""
    request = request_from_json(dp, name, version, body)
    stream = dp.infer_stream(request).__aiter__()
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        first = None

    async def events() -> AsyncIterator[bytes]:
        if first is None:
            return
        yield b"data: " + response_json(first) + b"\n\n"
        try:
            async for response in stream:
                yield b"data: " + response_json(response) + b"\n\n"
        except ServeError as exc:
            yield b"data: " + json.dumps({"error": exc.message}).encode() + b"\n\n"

    return events()
