"""The model host's side of coalesced requests (serve/coalesce.py): one request made of several client
requests' rows runs as ONE entry of its model's batcher when nothing about the model is per request,
else its parts run one by one exactly as if they had never been coalesced.

Answers: ("one", the coalesced response, limit) -- the front-end cuts it back by rows -- or ("parts" when
they ran together, "one_by_one" when not, [a response or an error per part], limit); ``limit`` is how
many rows this host would coalesce for the model now (0: none), which the front-end remembers."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from azulite.errors import ServeError, Unavailable
from azulite.serve.backends.base import WorkItem
from azulite.serve.coalesce import PartResults, split_request
from azulite.serve.counted import Counted
from azulite.serve.parameters import request_int, requested_names
from azulite.serve.types import InferRequest

if TYPE_CHECKING:
    from azulite.serve.dataplane import TritonDataPlane
    from azulite.serve.models import LoadedModel


class CoalescedCounts:
    """What the front-ends coalesced, per model: ``azulite_coalesced_requests_total{model,ran}`` (client
    requests that reached this host coalesced; ``ran`` "together" as one entry of the batcher, or
    "one_by_one") and ``azulite_coalesced_total{model}`` (the coalesced requests carrying them: the two
    give the mean rows a front-end's merge saved the host)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}
        self.groups: dict[str, int] = {}

    def count(self, model: str, ran: str, n: int) -> None:
        self.groups[model] = self.groups.get(model, 0) + 1
        self.requests[(model, ran)] = self.requests.get((model, ran), 0) + n

    def metrics(self):
        from prometheus_client.core import Metric

        requests = Metric("azulite_coalesced_requests", "Client requests front-ends coalesced before the model "
                          "host, by how they ran", "counter")
        for (model, ran), n in sorted(self.requests.items()):
            requests.add_sample("azulite_coalesced_requests_total", {"model": model, "ran": ran}, n)
        groups = Metric("azulite_coalesced", "Coalesced requests (each several clients' requests) the model host "
                        "received", "counter")
        for model, n in sorted(self.groups.items()):
            groups.add_sample("azulite_coalesced_total", {"model": model}, n)
        yield requests
        yield groups


def coalesce_limit(dp: TritonDataPlane, model: LoadedModel) -> int:
    """Rows of a coalesced request this model may take as one (0: its requests must run one by one):
    only a dynamically batched model with nothing per request (no sequence, decoupled answers, response
    cache, queue size limit, and no tracer sampling requests; a fallback or output monitor the caller
    has ruled out already)."""
    batcher = model.batcher
    if (batcher is None or model.sequence or model.decoupled or not batcher.settings.dynamic
            or (model.response_cache and dp.cache is not None) or dp.tracer.active
            or any(policy.max_queue_size for policy in batcher.settings.policies)):
        return 0
    return model.max_batch_size


async def infer_coalesced(dp: TritonDataPlane, request: InferRequest, parts: list[tuple[str, int]]
                          ) -> tuple[str, Any, int]:
    """Raises what every part would have got (the server closing, the model unknown or not ready, the
    batch failing, a timeout in the queue); a part's own error comes back in its place."""
    if dp._closing:
        raise Unavailable("the server is shutting down and accepts no new requests")
    cached = dp._cached_policies(request.model_name)
    if cached is not None and (cached[1] is not None or cached[2] is not None):  # a fallback or output monitor
        return "one_by_one", await _one_by_one(dp, request, parts), 0
    model = dp.manager.get(request.model_name, request.model_version)
    limit = coalesce_limit(dp, model)
    if sum(rows for _, rows in parts) > limit:
        return "one_by_one", await _one_by_one(dp, request, parts), limit
    try:
        item = dp._prepare(model, request)
        priority = request_int(request, "priority") if "priority" in request.parameters else 0
        timeout = request_int(request, "timeout") if "timeout" in request.parameters else 0
    except ServeError:  # its message would name the coalesced shape: each part gets its own
        return "one_by_one", await _one_by_one(dp, request, parts), limit
    wanted = list(model.outputs) if item.outputs is None else requested_names(request)
    item.parts, item.requests = parts, len(parts)
    with Counted(dp, model, "BACKEND", n=len(parts)) as counted:
        outputs = await model.batcher.submit(item, priority=priority, timeout_us=timeout)  # type: ignore[union-attr]
        if not isinstance(outputs, PartResults):
            return "one", dp._respond(model, request, item, outputs, wanted), limit
        answers: list[Any] = []
        failed = 0
        for sub, result in zip(split_request(request, parts), outputs):
            try:
                if isinstance(result, BaseException):
                    raise result
                part = WorkItem(inputs={}, outputs=item.outputs, batch_size=int(sub.inputs[0].shape[0]),
                                request_id=sub.id)
                answers.append(dp._respond(model, sub, part, result, wanted))
            except ServeError as exc:
                answers.append(exc)
                failed += 1
        if failed:
            model.stats.failed(time.perf_counter_ns() - counted.start, "BACKEND", failed)
            counted.n -= failed
        return "parts", answers, limit


async def _one_by_one(dp: TritonDataPlane, request: InferRequest, parts: list[tuple[str, int]]) -> list:
    """Each part as its own request (dp.infer: every policy and check of the model applies to it)."""
    return list(await asyncio.gather(*(dp.infer(sub) for sub in split_request(request, parts)),
                                     return_exceptions=True))
