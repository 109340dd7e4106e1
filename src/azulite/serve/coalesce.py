"""Requests a front-end merges before the model host sees them (``azulite serve --workers N``).

Why: with N front-ends, every request crosses to the one model host, whose loop then did per request
what a single-process server does once (read a frame, build the request, a Task, the batcher's entry, the
answer's frame): measured on 16 cores (docs/perf-workers.md, stop 43) that host saturated at 0.88-0.97 of
a core while the front-ends had cores to spare, so more front-ends added latency, not throughput. A
front-end that read several requests for one model in one pass of its loop now sends them as ONE request
whose inputs are their rows stacked (one block per input in the shared arena), and splits the one answer
back into theirs: the host's work is per merged request, and the batcher still sees every row (it is
row-aware: a merged request of 12 rows is 12 rows of a batch).

What a client sees does not change:
- Only requests that a dynamic batcher would have put into one batch anyway merge: the same model,
  version, requested outputs and parameters, the same input names, datatypes and shapes past the batch
  dimension, numeric tensors in the request itself (not in a shared-memory region), no sequence
  parameters, no trace context. The host merges only for a model with dynamic batching and none of
  what is per request (sequences, decoupled, response cache, fallback or output monitor, queue limits,
  a tracer on); else it runs them one by one (:func:`azulite.serve.coalesce_host.infer_coalesced`).
- A Python model's ``execute`` still gets one request per client request (:func:`expand` before the
  batch is handed to it, :func:`regroup` after), each with its own id: its per-request errors and
  outputs stay per request (:class:`PartResults`).
- Statistics count client requests: a merged request carries ``requests`` (serve/stats.py counts its
  queue and compute durations that many times, the pending gauge too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from azulite.serve import merge, shm_ring
from azulite.serve.backends.base import WorkItem
from azulite.serve.types import InferRequest, InferResponse, InferTensor, RequestedOutput

#: request parameters that make a request part of a sequence: never merged
_SEQUENCE = ("sequence_id", "sequence_start", "sequence_end")


def _frozen(parameters: dict) -> tuple | None:
    """Parameters as a hashable key (None: a value that is not hashable, e.g. a list: not worth comparing)."""
    if not parameters:
        return ()
    key = tuple(sorted(parameters.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def merge_key(request: InferRequest) -> tuple | None:
    """What requests must share to merge, or None when this one never merges."""
    params = request.parameters
    if request.trace_context is not None or (params and any(k in params for k in _SEQUENCE)):
        return None
    params_key = _frozen(params)
    if params_key is None:
        return None
    outputs = None
    if request.outputs is not None:
        out = []
        for o in request.outputs:
            p = _frozen(o.parameters)
            if p is None or "shared_memory_region" in o.parameters:
                return None
            out.append((o.name, p))
        outputs = tuple(out)
    sig = []
    for t in request.inputs:
        d = t.data
        if t.parameters or type(d) is not np.ndarray or d.ndim == 0 or d.dtype.hasobject or not d.shape[0]:
            return None
        sig.append((t.name, t.datatype, d.shape[1:], d.dtype))
    if not sig:
        return None
    return (request.model_name, request.model_version, outputs, params_key, tuple(sig))


def pack_merged(arena, requests: list[InferRequest], packed: shm_ring.Packed) -> tuple[InferRequest, list]:
    """One request of the requests' rows (every input one block: shm_ring.put_rows) as the host's
    header needs it: (the merged request, its input descriptors); :func:`parts_of` gives what to split
    the answer by."""
    first = requests[0]
    metas = []
    for j, t in enumerate(first.inputs):
        arrays = [r.inputs[j].data for r in requests]
        metas.append((t.name, t.datatype, (sum(a.shape[0] for a in arrays), *t.data.shape[1:]), {},
                      len(packed.refs)))
        shm_ring.put_rows(arena, arrays, packed)
    merged = InferRequest(model_name=first.model_name, inputs=[], model_version=first.model_version,
                          outputs=first.outputs, parameters=first.parameters, front_end=first.front_end,
                          recv_start=first.recv_start, recv_end=requests[-1].recv_end)
    return merged, metas


def chunks(entries: list, limit: int, rows: Callable[[Any], int]) -> Iterator[list]:
    """Consecutive runs of entries whose rows sum to at most ``limit`` (0: not known yet, one run)."""
    if not limit:
        yield entries
        return
    chunk: list = []
    total = 0
    for entry in entries:
        n = rows(entry)
        if chunk and total + n > limit:
            yield chunk
            chunk, total = [], 0
        chunk.append(entry)
        total += n
    if chunk:
        yield chunk


def parts_of(requests: list[InferRequest]) -> list[tuple[str, int]]:
    return [(r.id, int(r.inputs[0].data.shape[0])) for r in requests]


def _row_slices(parts: list[tuple[str, int]]):
    """(id, rows, slice of its rows) of each part, in row order."""
    at = 0
    for rid, rows in parts:
        yield rid, rows, slice(at, at + rows)
        at += rows


def split_response(response: InferResponse, parts: list[tuple[str, int]]) -> list[InferResponse]:
    """The merged answer cut back into each request's (views of its rows; ids and parameters per request)."""
    return [InferResponse(model_name=response.model_name, model_version=response.model_version, id=rid,
                          parameters=dict(response.parameters),
                          outputs=[InferTensor(t.name, t.datatype, (rows, *t.shape[1:]), t.data[cut], t.parameters)
                                   for t in response.outputs])
            for rid, rows, cut in _row_slices(parts)]


def split_request(request: InferRequest, parts: list[tuple[str, int]]) -> list[InferRequest]:
    """A merged request cut back into the requests it was made of (views of their rows)."""
    return [InferRequest(model_name=request.model_name, model_version=request.model_version, id=rid,
                         inputs=[InferTensor(t.name, t.datatype, (rows, *t.shape[1:]), t.data[cut], t.parameters)
                                 for t in request.inputs],
                         parameters=dict(request.parameters),
                         outputs=None if request.outputs is None else
                         [RequestedOutput(o.name, dict(o.parameters)) for o in request.outputs],
                         front_end=request.front_end, recv_start=request.recv_start, recv_end=request.recv_end)
            for rid, rows, cut in _row_slices(parts)]


# --- the batcher's side: a model whose execute sees requests (Python) gets them one by one ---------------

class PartResults(list):
    """A merged request's results per part (one of them an error, or outputs that are not one row per
    input row): the host answers each part on its own, as if they had never merged."""


def expand(items: list[WorkItem], model: str) -> tuple[list[WorkItem], list[int] | None]:
    """The batch's items with every merged one cut back into its parts (merge.split_outputs: views of
    their rows), and how many each became (None: nothing was merged, the items as they are)."""
    if all(item.parts is None for item in items):
        return items, None
    out: list[WorkItem] = []
    counts: list[int] = []
    for item in items:
        if item.parts is None:
            out.append(item)
            counts.append(1)
            continue
        pieces = merge.split_outputs(item.inputs, [rows for _, rows in item.parts], model=model)
        out.extend(WorkItem(inputs=inputs, outputs=item.outputs, batch_size=rows, request_id=rid,
                            parameters=item.parameters) for (rid, rows), inputs in zip(item.parts, pieces))
        counts.append(len(item.parts))
    return out, counts


def regroup(results: list, items: list[WorkItem], counts: list[int]) -> list:
    """Per original item: its result, or for a merged one its parts' outputs stacked back into one
    (each output one row per input row, one dtype and shape past the first dimension), else its
    :class:`PartResults`."""
    out: list[Any] = []
    at = 0
    for item, n in zip(items, counts):
        if item.parts is None:
            out.append(results[at])
            at += 1
            continue
        subs = results[at:at + n]
        at += n
        out.append(_stacked(subs, item.parts))
    return out


def _stacked(subs: list, parts) -> Any:
    first = subs[0]
    if not isinstance(first, dict):
        return PartResults(subs)
    names = list(first)
    for sub, (_, rows) in zip(subs, parts):
        if not isinstance(sub, dict) or len(sub) != len(names):
            return PartResults(subs)
        for name in names:
            a = sub.get(name)
            if (type(a) is not np.ndarray or a.ndim == 0 or a.shape[0] != rows or a.dtype.hasobject
                    or a.dtype != first[name].dtype or a.shape[1:] != first[name].shape[1:]):
                return PartResults(subs)
    return merge.merge_inputs(subs, [rows for _, rows in parts])
