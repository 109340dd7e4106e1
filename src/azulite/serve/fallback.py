"""Graceful degradation: a model may name a lighter fallback model in its config, used when the model is
unloaded or unavailable, when its execution fails, when its queue is full (Triton's ``max_queue_size``
rejection) or when its queue reaches a threshold. The answer says so in its parameters
(``fallback_from``, ``fallback_reason``) and each use is counted (``azulite_fallback_total``).

```
parameters { key: "azulite_fallback_model" value: { string_value: "densenet_small" } }
parameters { key: "azulite_fallback_queue_threshold" value: { string_value: "64" } }   # optional
```

A client's own mistakes (a wrong input, a bad shape) are never retried on the fallback: only the
primary's inability to answer is. The fallback must take the same inputs and give the same outputs.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from azulite.errors import Internal, ModelLoadError, ServeError, Unavailable
from azulite.serve.batcher import Rejected
from azulite.serve.proto import model_config_pb2 as mc

log = logging.getLogger("azulite.serve")

MODEL_PARAM = "azulite_fallback_model"
THRESHOLD_PARAM = "azulite_fallback_queue_threshold"
#: why a request went to the fallback (the reason label of the metric and response parameter)
REASONS = ("unavailable", "queue_threshold", "queue_full", "failed")


@dataclass(frozen=True, slots=True)
class FallbackPolicy:
    model: str
    #: queued requests of the primary at which new ones go to the fallback (0: only when it cannot answer)
    queue_threshold: int = 0


def policy_of(config: mc.ModelConfig) -> FallbackPolicy | None:
    """The config's fallback parameters, validated (a ModelLoadError names the bad parameter)."""
    params = config.parameters
    if MODEL_PARAM not in params:
        if THRESHOLD_PARAM in params:
            raise ModelLoadError(f"model '{config.name}': parameter '{THRESHOLD_PARAM}' needs '{MODEL_PARAM}'",
                                 fix=f'add parameters {{ key: "{MODEL_PARAM}" value: {{ string_value: "MODEL" }} }}')
        return None
    target = params[MODEL_PARAM].string_value.strip()
    if not target or target == config.name:
        raise ModelLoadError(f"model '{config.name}': parameter '{MODEL_PARAM}' must name another model, "
                             f"got {target!r}", fix="name a lighter model of the same repository")
    threshold = 0
    if THRESHOLD_PARAM in params:
        text = params[THRESHOLD_PARAM].string_value.strip()
        if not text.isdigit():
            raise ModelLoadError(f"model '{config.name}': parameter '{THRESHOLD_PARAM}' must be a whole number "
                                 f"of queued requests, got {text!r}", fix='e.g. string_value: "64"')
        threshold = int(text)
    return FallbackPolicy(target, threshold)


def fallback_metrics(counts: dict[tuple[str, str, str], int]):
    """``azulite_fallback_total{model,fallback,reason}`` from the data plane's counts (at scrape time)."""
    from prometheus_client.core import Metric

    metric = Metric("azulite_fallback_total", "Requests answered by a model's fallback, by reason", "counter")
    for (model, fallback, reason), n in sorted(counts.items()):
        metric.add_sample("azulite_fallback_total", {"model": model, "fallback": fallback, "reason": reason}, n)
    yield metric


def unanswered(model: str, fallback: str, reason: str, primary: ServeError | None, exc: ServeError) -> ServeError:
    """The error for a request neither its model nor its fallback could answer: the model's own (a full
    queue's 503 and Retry-After, say), not the fallback's -- whose name a key scoped to the model must not
    learn, and whose 404 would tell a client the model it asked for is unknown."""
    log.warning("model '%s' could not answer (%s) and its fallback '%s' could not either: %s", model, reason,
                fallback, exc.message)
    if primary is not None:
        return primary
    return Unavailable(f"model '{model}' is past its fallback queue threshold, and its fallback cannot answer now",
                       fix="retry later")


async def answer_with_fallback(request, policy: FallbackPolicy, *, get_model, infer, counts: dict):
    """The primary's answer when it can give one; else the fallback's, marked and counted.
    ``get_model(name, version)`` and ``infer(request)`` are the data plane's; ``counts`` its tally."""
    reason = None
    primary: ServeError | None = None  # what the client gets when the fallback cannot answer either
    try:
        model = get_model(request.model_name, request.model_version)
    except Unavailable as exc:
        reason, primary = "unavailable", exc
    else:
        if policy.queue_threshold and model.batcher is not None and model.batcher.queued >= policy.queue_threshold:
            reason = "queue_threshold"
    if reason is None:
        try:
            return await infer(request)
        except Rejected as exc:
            if "queue size" not in exc.message:
                raise  # the request's own timeout: not the model's inability to answer
            reason, primary = "queue_full", exc
        except (Internal, Unavailable) as exc:
            reason, primary = "failed", exc
    try:
        response = await infer(dataclasses.replace(request, model_name=policy.model, model_version=""))
    except Unavailable as exc:  # the fallback is unloaded, or full too: the primary's answer, not the fallback's
        raise unanswered(request.model_name, policy.model, reason, primary, exc) from None
    response.parameters["fallback_from"] = request.model_name
    response.parameters["fallback_reason"] = reason
    key = (request.model_name, policy.model, reason)
    counts[key] = counts.get(key, 0) + 1
    return response
