"""Decoupled models (``model_transaction_policy { decoupled: true }``): a request gets 0..n responses,
sent by the model through its response sender (pb_utils.InferenceResponseSender) from any thread, during
or after ``execute``; the last send carries TRITONSERVER_RESPONSE_COMPLETE_FINAL.

The request still goes through the model's batcher (so decoupled requests batch like any other); its
WorkItem carries a ``sink`` that hands each response to this request's queue on the event loop, and
:func:`stream` yields them as :class:`InferResponse` until the final one. gRPC ``ModelStreamInfer`` sends
each as a stream message; unary infer (HTTP or gRPC) refuses a decoupled model, as Triton does.

As Triton: every streamed response carries ``triton_final_response`` (true on the one the model sent with
the final flag, on a non-decoupled model's single response and on an error); a request parameter
``triton_enable_empty_final_response`` (bool) also sends an empty final response when the model closes
without one (checked against real Triton 2.51 in tests/serve/test_decoupled.py).

A decoupled model's fallback and output monitor (serve/fallback.py, serve/drift.py) apply as they do to
unary requests: :func:`stream_with_policies` adds each streamed response to the drift windows, and sends
the request to the fallback when the model is unavailable, past its queue threshold, or refuses or fails
it before its first response (after one, the stream is the model's: a client cannot be handed half of one
model's answers and half of another's).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from azulite.errors import Internal, InvalidArgument, ServeError, Unavailable, Unsupported
from azulite.serve.backends.base import Timing
from azulite.serve.batcher import Rejected
from azulite.serve.counted import Counted
from azulite.serve.ensemble import step_request, stream_ensemble
from azulite.serve.fallback import unanswered
from azulite.serve.parameters import request_int, requested_names
from azulite.serve.types import InferRequest, InferResponse

if TYPE_CHECKING:
    from azulite.serve.dataplane import TritonDataPlane
    from azulite.serve.models import LoadedModel

EMPTY_FINAL = "triton_enable_empty_final_response"
FINAL_FLAG = "triton_final_response"


def unary_refused(model: "LoadedModel") -> Unsupported:
    """As real Triton answers it (checked in tests/serve/test_decoupled.py): 501 / UNIMPLEMENTED."""
    return Unsupported(
        f"model '{model.name}' is decoupled (model_transaction_policy.decoupled: it sends 0..n responses per "
        "request): unary infer cannot answer it", fix="call it over gRPC ModelStreamInfer (a streaming client)")


async def stream(dp: "TritonDataPlane", model: "LoadedModel", request: InferRequest,
                 guarded: bool = True) -> AsyncIterator[InferResponse]:
    """The responses of one request to a decoupled model, in the order the model sent them. ``guarded``
    False: a step of an ensemble request in flight, which shutdown lets finish."""
    if guarded and dp._closing:
        raise Unavailable("the server is shutting down and accepts no new requests")
    dp.shm.resolve_inputs(request)
    if dp.shm.output_places(request):
        raise InvalidArgument(f"model '{model.name}' is decoupled: its outputs cannot be placed in shared memory "
                              "regions (a request may get many responses)", fix="receive them in the stream")
    if model.is_ensemble:
        async with contextlib.aclosing(_ensemble_stream(dp, model, request)) as responses:
            async for response in responses:
                yield response
        return
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def sink(result, final: bool) -> None:  # any thread
        loop.call_soon_threadsafe(queue.put_nowait, (result, final))

    def executed(future: asyncio.Future) -> None:  # a failed execute ends the request with its error
        if future.cancelled():
            queue.put_nowait((ServeError("the request was cancelled"), True))
        elif future.exception() is not None:
            queue.put_nowait((future.exception(), True))

    empty_final = bool(request.parameters.get(EMPTY_FINAL, False))
    with Counted(dp, model) as counted:
        item = dp._prepare(model, request)
        counted.reason = "BACKEND"
        item.sink = sink
        if dp.tracer.active:  # serve/trace.py: the trace ends with the final response
            item.trace = counted.trace = dp.tracer.sample(model.name, model.version, request.id, request.trace_context)
        wanted = list(model.outputs) if item.outputs is None else requested_names(request)
        future = model.batcher.submit(item, priority=request_int(request, "priority"),
                                      timeout_us=request_int(request, "timeout"))
        future.add_done_callback(executed)
        while True:
            result, final = await queue.get()
            if isinstance(result, BaseException):
                raise result
            if result is not None:
                response = dp._respond(model, request, item, result, wanted)
            elif final and empty_final:
                response = InferResponse(model.name, model.version_str, [], id=request.id)
            else:
                break  # the final flag alone
            response.parameters[FINAL_FLAG] = final
            yield response
            if final:
                break
        if counted.trace is not None and not future.done():
            # a final response sent from inside execute comes before execute returns: the trace takes the
            # batch's compute times when it does (the client has every response already)
            await asyncio.wait([future])


async def _ensemble_stream(dp: "TritonDataPlane", model: "LoadedModel", request: InferRequest
                           ) -> AsyncIterator[InferResponse]:
    """An ensemble with a decoupled step (serve/ensemble.py, stream_ensemble): a response per response of
    the decoupled step that came through the steps after it, the last marked final when it is known to be
    (the decoupled step had sent its final flag by then), else, when the request asks for it, an empty
    final response after it: as Triton 2.51 streams such an ensemble (tests/serve/test_decoupled_ensemble.py).
    Counted as one request; not traced."""
    empty_final = bool(request.parameters.get(EMPTY_FINAL, False))
    with Counted(dp, model) as counted:
        item, wanted, _, _ = dp._admit(model, request, counted, sample=False)
        began = time.perf_counter_ns()
        plan = model.ensemble_plan
        async with contextlib.aclosing(stream_ensemble(
                model.name, plan, item.inputs, dp._run_step, functools.partial(_step_stream, dp, request.id),
                lambda step: dp.manager.get(step.model, step.version).decoupled)) as pools:
            last = False
            async for pool, last in pools:
                response = dp._respond(model, request, item, pool, wanted)
                response.parameters[FINAL_FLAG] = last
                yield response
        model.stats.executed(item.batch_size or 1, [began - counted.start],
                             Timing(infer_ns=time.perf_counter_ns() - began), ok=True)
    if empty_final and not last:
        response = InferResponse(model.name, model.version_str, [], id=request.id)
        response.parameters[FINAL_FLAG] = True
        yield response


async def _step_stream(dp: "TritonDataPlane", request_id: str, name: str, version: str, feed: dict, wanted: list[str]
                       ) -> AsyncIterator[dict]:
    """A decoupled step's responses, as the tensors each carries."""
    request = step_request(name, version, feed, wanted, request_id)
    async with contextlib.aclosing(stream(dp, dp.manager.get(name, version), request, guarded=False)) as responses:
        async for response in responses:
            yield {t.name: t.data for t in response.outputs}


async def stream_with_policies(dp: "TritonDataPlane", model: "LoadedModel | None", request: InferRequest,
                               policy, monitor, unavailable: ServeError | None = None
                               ) -> AsyncIterator[InferResponse]:
    """:func:`stream` with the model's fallback ``policy`` (a FallbackPolicy or None) and output
    ``monitor`` (an OutputMonitor or None). ``model`` None: the model is not available (``unavailable``
    says why: what the client gets if the fallback cannot answer either)."""
    if dp._closing:
        raise Unavailable("the server is shutting down and accepts no new requests")
    reason = None
    primary = unavailable  # the model's own error, for when the fallback cannot answer either
    if model is None:
        reason = "unavailable"
    elif (policy is not None and policy.queue_threshold and model.batcher is not None
          and model.batcher.queued >= policy.queue_threshold):
        reason = "queue_threshold"
    if reason is None:
        sent = False
        try:
            async with contextlib.aclosing(stream(dp, model, request)) as responses:  # closed with this one
                async for response in responses:
                    if monitor is not None:
                        monitor.observe([(t.name, t.data) for t in response.outputs])
                    sent = True
                    yield response
            return
        except Rejected as exc:
            if sent or policy is None or "queue size" not in exc.message:
                raise  # the request's own timeout, or answers already sent: not the fallback's to finish
            reason, primary = "queue_full", exc
        except (Internal, Unavailable) as exc:
            if sent or policy is None:
                raise
            reason, primary = "failed", exc
    assert policy is not None
    key = (request.model_name, policy.model, reason)
    fallback = dataclasses.replace(request, model_name=policy.model, model_version="")
    counted = False
    try:
        async with contextlib.aclosing(dp.stream_unguarded(fallback)) as responses:
            async for response in responses:
                if not counted:
                    dp.fallbacks[key] = dp.fallbacks.get(key, 0) + 1
                    counted = True
                response.parameters["fallback_from"] = request.model_name
                response.parameters["fallback_reason"] = reason
                yield response
        if not counted:  # answered with no response (a decoupled fallback may send none)
            dp.fallbacks[key] = dp.fallbacks.get(key, 0) + 1
    except Unavailable as exc:
        if counted:
            raise
        raise unanswered(request.model_name, policy.model, reason, primary, exc) from None
