"""The protobuf answers of the HTTP front-end (metadata, config, statistics, repository index) rendered as
Triton renders them: proto field names, numbers for 64-bit integers."""

from __future__ import annotations

import json
import math
from typing import Any

from google.protobuf import descriptor as _descriptor
from google.protobuf import json_format
from google.protobuf.message import Message

class NumberTooBig(ValueError):
    """A JSON number no double holds (``1e400``)."""


def _finite(text: str) -> float:
    """A JSON number's value, refused when a double cannot hold it (``1e400``, which Python reads as
    infinity; Triton's parser refuses it too). ``Infinity`` and ``NaN``, written as such, stay accepted."""
    value = float(text)
    if math.isinf(value):
        raise NumberTooBig(f"number {text} is too big to be stored in a double")
    return value


_DECODE = json.JSONDecoder(parse_float=_finite).decode


def loads(data: str | bytes | memoryview) -> Any:
    """A JSON document (UTF-8 when bytes) -> Python objects, by the standard library (``NaN``, ``Infinity``,
    integers past 64 bits, which orjson refuses), refusing numbers past a double's range (ValueError)."""
    return _DECODE(data if isinstance(data, str) else str(data, "utf-8"))


_INT64_TYPES = {
    _descriptor.FieldDescriptor.TYPE_INT64,
    _descriptor.FieldDescriptor.TYPE_UINT64,
    _descriptor.FieldDescriptor.TYPE_SINT64,
    _descriptor.FieldDescriptor.TYPE_FIXED64,
    _descriptor.FieldDescriptor.TYPE_SFIXED64,
}


def _repeated(fd) -> bool:
    return fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED


def _fix_int64(message: Message, value: Any) -> Any:
    """json_format renders 64-bit integers as strings (proto3 JSON); Triton answers numbers."""
    if not isinstance(value, dict):
        return value
    fields = message.DESCRIPTOR.fields_by_name
    for key, item in value.items():
        fd = fields.get(key)
        if fd is None:
            continue
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            vfd = fd.message_type.fields_by_name["value"]
            container = getattr(message, key)
            kfd = fd.message_type.fields_by_name["key"]
            if vfd.message_type is not None:
                for k in item:
                    _fix_int64(container[k if kfd.type == kfd.TYPE_STRING else int(k)], item[k])
            elif vfd.type in _INT64_TYPES:
                for k in item:
                    item[k] = int(item[k])
        elif fd.message_type is not None:
            sub = getattr(message, key)
            if _repeated(fd):
                for m, v in zip(sub, item):
                    _fix_int64(m, v)
            else:
                _fix_int64(sub, item)
        elif fd.type in _INT64_TYPES:
            value[key] = [int(v) for v in item] if isinstance(item, list) else int(item)
    return value


def message_to_json(message: Message, *, defaults: bool = True) -> dict[str, Any]:
    """A protobuf message as Triton renders it over HTTP: proto field names, numbers for int64."""
    doc = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=defaults)
    return _fix_int64(message, doc)


def model_metadata_json(msg) -> dict[str, Any]:
    def tensors(items):
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]

    return {"name": msg.name, "versions": list(msg.versions), "platform": msg.platform,
            "inputs": tensors(msg.inputs), "outputs": tensors(msg.outputs)}


def server_metadata_json(msg) -> dict[str, Any]:
    return {"name": msg.name, "version": msg.version, "extensions": list(msg.extensions)}


def repository_index_json(msg) -> list[dict[str, Any]]:
    out = []
    for m in msg.models:
        entry = {"name": m.name}
        if m.version:
            entry["version"] = m.version
        if m.state:
            entry["state"] = m.state
        if m.reason:
            entry["reason"] = m.reason
        out.append(entry)
    return out
