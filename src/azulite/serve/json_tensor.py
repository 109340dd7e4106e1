"""A tensor written as JSON in an HTTP infer request (``"data": [...]``, flat or nested by its shape) ->
a numpy array of its datatype, each element checked: of the JSON kind the datatype takes (a bool is no
number, a float no integer), within the datatype's range (a finite number past it is refused, not made
infinite), the wrong one named by its index and value (serve/http_codec.py decodes the rest)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from azulite.errors import InvalidArgument


def _flatten(data: Any) -> list:
    if data and isinstance(data[0], list):
        flat: list = []
        stack = [data]
        while stack:  # nested lists, depth first, row-major
            item = stack.pop()
            if isinstance(item, list):
                stack.extend(reversed(item))
            else:
                flat.append(item)
        return flat
    return data


#: the JSON value types a numeric tensor's 'data' may hold, by numpy kind
_JSON_TYPES = {"b": {bool}, "i": {int}, "u": {int}, "f": {int, float}}


def json_input(name: str, datatype: str, shape: tuple[int, ...], dtype: np.dtype, data: Any) -> np.ndarray:
    if not isinstance(data, list):
        raise InvalidArgument(f"input '{name}': 'data' must be a JSON array, got {type(data).__name__}")
    flat = _flatten(data)
    count = math.prod(shape)
    if len(flat) != count:
        raise InvalidArgument(
            f"input '{name}': shape {list(shape)} needs {count} elements, 'data' has {len(flat)}",
            fix="send exactly prod(shape) elements, flattened row-major or nested")
    if datatype == "BYTES":
        out = np.empty(count, dtype=np.object_)
        for i, v in enumerate(flat):
            if not isinstance(v, str):
                raise InvalidArgument(f"input '{name}': BYTES elements must be JSON strings, element {i} is {v!r}")
            out[i] = v.encode()
        return out.reshape(shape)
    if datatype == "FP16":
        raise InvalidArgument(f"input '{name}': FP16 data cannot be sent as JSON",
                              fix="send it with the binary tensor data extension (binary_data_size)")
    try:
        # the set of the elements' exact types (a bool is no number here, though Python's bool is an int)
        if not set(map(type, flat)) <= _JSON_TYPES[dtype.kind]:
            raise TypeError
        with np.errstate(over="raise"):  # a finite number past the type's range is refused, not made infinite
            return np.array(flat, dtype=dtype).reshape(shape)
    except (FloatingPointError, OverflowError):  # a float past the type's range; an int past it (numpy 2)
        low, high = ((f"{np.finfo(dtype).min:g}", f"{np.finfo(dtype).max:g}") if dtype.kind == "f" else
                     (np.iinfo(dtype).min, np.iinfo(dtype).max))
        raise InvalidArgument(f"input '{name}': element {_first_overflow(flat, dtype)} of 'data' is past the "
                              f"range of {datatype} ({low} to {high})",
                              fix=f"send values within {datatype}'s range, or use a wider datatype") from None
    except (TypeError, ValueError):
        allowed = _JSON_TYPES[dtype.kind]
        i, bad = next(((i, v) for i, v in enumerate(flat) if type(v) not in allowed), (0, flat[0] if flat else None))
        info = np.iinfo(dtype) if dtype.kind in "iu" else None
        if info is not None and type(bad) is float and not info.min <= bad <= info.max:
            # an integer past 64 bits, which orjson reads as a float, or any number past the type's range
            raise InvalidArgument(f"input '{name}': element {i} of 'data' is past the range of {datatype} "
                                  f"({info.min} to {info.max})",
                                  fix=f"send values within {datatype}'s range, or use a wider datatype") from None
        kind = {"b": "true or false", "f": "a number"}.get(dtype.kind, "a whole number") + f" ({datatype})"
        if info is not None and type(bad) is float and bad.is_integer():  # maybe past 64 bits, read as a float
            kind = f"a whole number within {datatype}'s range ({info.min} to {info.max})"
        raise InvalidArgument(f"input '{name}': element {i} of 'data' is {json_text(bad)}, not {kind}",
                              fix=f"send JSON {'booleans' if datatype == 'BOOL' else 'numbers'} for {datatype}"
                                  + (" without a fraction or exponent" if dtype.kind in "iu" else "")) from None


def json_text(value: Any) -> str:
    """An element as the client wrote it (near enough) for an error: JSON's spelling, a bounded length."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _first_overflow(flat: list, dtype: np.dtype) -> int:
    """Index of the first element that overflows ``dtype`` (only on the error's path)."""
    with np.errstate(over="raise"):
        for i, v in enumerate(flat):
            try:
                dtype.type(v)
            except (FloatingPointError, OverflowError):
                return i
    return 0
