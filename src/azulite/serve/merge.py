"""Pure functions of dynamic batching: merge the inputs of several requests into one batch along the
batch dimension, and split the batch's outputs back, each request getting exactly its share. No queue,
no clock, no model: the queue (batch_queue.py) decides *which* requests go together; this decides *how*.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from azulite.errors import Internal


def merge_inputs(requests: Sequence[dict[str, np.ndarray]], sizes: Sequence[int]) -> dict[str, np.ndarray]:
    """One array per input name, the requests' arrays concatenated along axis 0 (one request: as is)."""
    if len(requests) == 1:
        return requests[0]
    return {name: np.concatenate([r[name] for r in requests]) for name in requests[0]}


def split_outputs(
    outputs: dict[str, np.ndarray], sizes: Sequence[int], *, model: str
) -> list[dict[str, np.ndarray]]:
    """The inverse of :func:`merge_inputs`. An output whose batch dimension is not the sum of the
    requests' batch sizes fails the whole batch (a model that drops or invents rows must not hand one
    request another's data)."""
    total = sum(sizes)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise Internal(
                f"model '{model}': output '{name}' has batch size "
                f"{array.shape[0] if array.ndim else 'none (a scalar)'}, expected {total} "
                f"(the sum of the batch sizes of the {len(sizes)} request(s) it ran)"
            )
    if len(sizes) == 1:
        return [outputs]
    # views by plain slices: np.split costs ~5 us per output more, on every batch
    results, start = [], 0
    for size in sizes:
        end = start + size
        results.append({name: array[start:end] for name, array in outputs.items()})
        start = end
    return results
