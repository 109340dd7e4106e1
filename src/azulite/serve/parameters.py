"""Request parameters as the data plane reads them: the ones a model sees, integers (priority, timeout),
the classification parameter's top-k and the extension's answer (top-k of an output as BYTES
"value:index[:label]"), and shape text for messages."""

from __future__ import annotations

import numpy as np

from azulite.errors import InvalidArgument
from azulite.serve.types import InferRequest


#: what the protocol itself reads (sequence batching, the scheduler, the HTTP and gRPC front-ends): Triton
#: consumes them and hands a model only the rest (its ``request.parameters()``, checked against 2.51 in
#: tests/serve/test_protocol_triton.py)
RESERVED = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                      "binary_data_output", "triton_enable_empty_final_response"})


def for_model(parameters: dict) -> dict:
    """The request's parameters a model sees: all but the protocol's own (:data:`RESERVED`)."""
    if not parameters or RESERVED.isdisjoint(parameters):
        return parameters
    return {k: v for k, v in parameters.items() if k not in RESERVED}


def request_int(request: InferRequest, key: str) -> int:
    value = request.parameters.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        try:
            return int(value)
        except (TypeError, ValueError):
            raise InvalidArgument(f"request parameter '{key}' must be an integer, got {value!r}") from None
    return int(value)


def requested_names(request: InferRequest) -> list[str]:
    """The outputs a request asks for, in its order, each once (Triton answers an output named twice once)."""
    names = [o.name for o in request.outputs or ()]
    return names if len(names) < 2 or len(set(names)) == len(names) else list(dict.fromkeys(names))


def shape_text(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def classify(array: np.ndarray, k: int, labels: list[str] | None, batched: bool, output: str = "") -> np.ndarray:
    """Triton's classification extension: the top-k of each batch item as BYTES "value:index[:label]"."""
    if array.dtype.kind == "b":
        array = array.astype(np.uint8)
    elif array.dtype.kind not in "iuf":  # BYTES: no order of classes to take the top of
        raise InvalidArgument(f"output '{output}': classification needs a numeric output, and this one is "
                              f"{'BYTES' if array.dtype.kind in 'OSU' else array.dtype}",
                              fix=f"drop the 'classification' parameter of output '{output}'")
    rows = array.reshape(array.shape[0], -1) if batched else array.reshape(1, -1)
    k = min(k, rows.shape[1])
    order = np.argsort(-rows, axis=1, kind="stable")[:, :k]
    out = np.empty((rows.shape[0], k), dtype=np.object_)
    for r in range(rows.shape[0]):
        for c, idx in enumerate(order[r]):
            text = f"{float(rows[r, idx]):f}:{int(idx)}"
            if labels is not None and idx < len(labels):
                text += f":{labels[idx]}"
            out[r, c] = text.encode()
    return out if batched else out[0]


def top_k(output: str, k: object) -> int:
    """The classification parameter: a positive integer (a client's mistake otherwise, never a 500)."""
    try:
        if isinstance(k, (bool, str, bytes)) or isinstance(k, float) and not k.is_integer():  # "2": as Triton,
            raise ValueError  # which wants an integer parameter
        n = int(k)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise InvalidArgument(f"output '{output}': parameter 'classification' must be a positive integer "
                              f"(how many top classes to return), got {k!r}", fix='e.g. "classification": 3')
    return n
