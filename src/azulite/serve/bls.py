"""Business Logic Scripting: a Python model's ``pb_utils.InferenceRequest.exec()``, run by the data plane
as a request of its own (checked, batched, counted in the called model's statistics) from the model's
instance thread, its answer or error handed back as Triton's Python backend hands it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from azulite.errors import ServeError
from azulite.serve import config as cfg
from azulite.serve.backends import pb_utils
from azulite.serve.types import InferRequest, InferTensor, RequestedOutput

if TYPE_CHECKING:
    from azulite.serve.dataplane import TritonDataPlane

#: ServeError.status -> the TritonError code a BLS response carries
_CODES = {"INVALID_ARGUMENT": pb_utils.TritonError.INVALID_ARG, "NOT_FOUND": pb_utils.TritonError.NOT_FOUND,
          "UNAVAILABLE": pb_utils.TritonError.UNAVAILABLE, "UNIMPLEMENTED": pb_utils.TritonError.UNSUPPORTED}


def bls_call(dp: TritonDataPlane, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
    """One BLS call, made from an instance thread (it blocks that thread, never the data plane's loop)."""
    if dp._loop is None:
        raise pb_utils.TritonModelException("BLS is available once the server serves requests")
    version = "" if request._model_version in (-1, None) else str(request._model_version)
    infer = InferRequest(
        model_name=request.model_name(),
        model_version=version,
        inputs=[InferTensor(t.name(), cfg.numpy_to_wire(t.as_numpy().dtype), t.as_numpy().shape, t.as_numpy())
                for t in request.inputs()],
        outputs=[RequestedOutput(n) for n in request.requested_output_names()] or None,
        id=request.request_id(),
    )
    # traced as its caller's child when the model passed the request's trace on (request.trace()), else
    # not at all: Triton samples at its front-ends, never a BLS call
    parent = request.trace()._trace
    try:
        result = asyncio.run_coroutine_threadsafe(dp._infer(infer, parent, sample=False), dp._loop).result()
    except ServeError as exc:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(exc.message, _CODES.get(
            exc.status, pb_utils.TritonError.INTERNAL)))
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(t.name, t.data) for t in result.outputs])
