"""Ensemble scheduling as Triton's: steps run as soon as every tensor their ``input_map`` names exists
(an ensemble input or an output of an earlier step), independent steps concurrently; each step is a request
to its composing model (so it is batched, counted and validated like any other).

A step goes straight into its composing model's batcher (:func:`step_item`, :func:`step_outputs`): its
arrays are checked against the model's config as a client's request would be, without building and
re-reading a wire-shaped request and response per step (measured: 5% less CPU per row for the DLRM
ensemble at 32 rows per request; README, DLRM benchmark).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import numpy as np

from azulite.errors import Internal, ModelLoadError, ServeError
from azulite.serve import config as cfg
from azulite.serve.backends.base import WorkItem
from azulite.serve.checks import check_inputs, check_outputs, output_array
from azulite.serve.proto import model_config_pb2 as mc
from azulite.serve.types import InferRequest, InferTensor, RequestedOutput

if TYPE_CHECKING:
    from azulite.serve.models import LoadedModel

StepRunner = Callable[[str, str, dict[str, np.ndarray], list[str]], Awaitable[dict[str, np.ndarray]]]
#: a decoupled step: its responses' outputs, in the order the model sent them
StepStreamer = Callable[[str, str, dict[str, np.ndarray], list[str]], AsyncIterator[dict[str, np.ndarray]]]


def check_ensemble(config: mc.ModelConfig, composing: Callable[[str], mc.ModelConfig],
                   versions: Callable[[str], set[int]] | None = None) -> None:
    """Every step's tensors exist on its model with the data type the ensemble gives them, every step input
    is produced, every output is made, and a step's pinned ``model_version`` is one that loaded: each would
    otherwise load READY and fail every request (naming a model the client never asked for)."""
    name = config.name
    dtypes = {t.name: (t.data_type, "ensemble input") for t in config.input}  # tensor -> (type, where from)
    steps = list(config.ensemble_scheduling.step)
    for index, step in enumerate(steps):
        model = composing(step.model_name)
        if step.model_version > 0 and versions is not None and step.model_version not in versions(step.model_name):
            have = ", ".join(map(str, sorted(versions(step.model_name)))) or "none"
            raise ModelLoadError(f"ensemble '{name}' step {index}: model '{step.model_name}' has no version "
                                 f"{step.model_version} loaded (loaded: {have})",
                                 fix="set the step's model_version to a loaded version, or -1 for the latest")
        model_inputs = {t.name for t in model.input}
        model_outputs = {t.name: t.data_type for t in model.output}
        for key in step.input_map:
            if key not in model_inputs:
                raise ModelLoadError(
                    f"ensemble '{name}' step {index}: '{key}' is not an input of model '{step.model_name}' "
                    f"(its inputs: {sorted(model_inputs)})"
                )
        for key, value in step.output_map.items():
            if key not in model_outputs:
                raise ModelLoadError(
                    f"ensemble '{name}' step {index}: '{key}' is not an output of model '{step.model_name}' "
                    f"(its outputs: {sorted(model_outputs)})"
                )
            dtypes.setdefault(value, (model_outputs[key], f"output '{key}' of model '{step.model_name}'"))
    for index, step in enumerate(steps):
        wants = {t.name: t.data_type for t in composing(step.model_name).input}
        for key, value in step.input_map.items():
            if value not in dtypes:
                raise ModelLoadError(
                    f"ensemble '{name}' step {index}: input tensor '{value}' is neither an ensemble input nor "
                    "produced by any step"
                )
            have, source = dtypes[value]
            if have != wants[key]:
                raise ModelLoadError(
                    f"ensemble '{name}' step {index}: tensor '{value}' ({source}) is {_dtype(have)}, but input "
                    f"'{key}' of model '{step.model_name}' takes {_dtype(wants[key])}",
                    fix="make the two data types agree (a step cannot convert between them)")
    for output in config.output:
        if output.name not in dtypes or dtypes[output.name][1] == "ensemble input":
            raise ModelLoadError(f"ensemble '{name}': output '{output.name}' is not produced by any step")
        have, source = dtypes[output.name]
        if have != output.data_type:
            raise ModelLoadError(f"ensemble '{name}': output '{output.name}' is {_dtype(output.data_type)} in its "
                                 f"config, but {source} is {_dtype(have)}", fix="make the two data types agree")


def check_decoupled_origins(config: mc.ModelConfig, composing: Callable[[str], mc.ModelConfig]) -> None:
    """Triton's rule for ensembles with decoupled steps: each tensor comes from the last decoupled step above
    it (or none, the ensemble's inputs), and a step's inputs (and the ensemble's outputs) must all come from
    the same one: a step after a decoupled step runs once per response of it, and a tensor from before it, or
    from another decoupled step, has no response to be paired with (Triton refuses such an ensemble with
    the words below; checked against 2.51 in tests/serve/test_decoupled_ensemble.py)."""
    name = config.name
    steps = list(config.ensemble_scheduling.step)
    origin: dict[str, str] = {t.name: "" for t in config.input}  # tensor -> the decoupled step it comes after
    above: dict[str, str] = {}  # a decoupled step -> the decoupled step its inputs came after ("" none)
    pending = list(range(len(steps)))
    while pending:
        progressed = False
        for index in list(pending):
            step = steps[index]
            if not all(v in origin for v in step.input_map.values()):
                continue
            pending.remove(index)
            progressed = True
            came = _same_origin(name, step.model_name, [origin[v] for v in step.input_map.values()])
            if composing(step.model_name).model_transaction_policy.decoupled:
                above[f"{index}:{step.model_name}"] = came
                came = f"{index}:{step.model_name}"
            for value in step.output_map.values():
                origin[value] = came
        if not progressed:  # a step whose input is never made: check_ensemble says which
            return
    reach = _same_origin(name, name, [origin[t.name] for t in config.output if t.name in origin])
    chain = set()  # the decoupled steps the ensemble's responses come through
    while reach:
        chain.add(reach)
        reach = above[reach]
    aside = sorted(d.split(":", 1)[1] for d in above if d not in chain)
    if aside:  # each response of such a step would run the steps after it for no response of the ensemble
        raise ModelLoadError(
            f"ensemble '{name}': decoupled step model(s) {', '.join(map(repr, aside))} lead to none of its outputs: "
            "azulite streams an ensemble through the decoupled steps its outputs come after, one chain",
            fix="remove the step, or make the ensemble's outputs come after it (Triton runs such a step and "
                "drops its responses)")


def _same_origin(ensemble: str, model: str, origins: list[str]) -> str:
    if len(set(origins)) > 1:
        raise ModelLoadError(
            f"in ensemble {ensemble}, step of model '{model}' receives inputs originated from different decoupled "
            f"models ({', '.join(sorted(o.split(':', 1)[1] if o else 'the ensemble inputs' for o in set(origins)))})",
            fix="a step after a decoupled step runs once per response of it: take every input of such a step "
                "(and every ensemble output) from that step's responses or the steps after it")
    return origins[0] if origins else ""


def _dtype(value: int) -> str:
    return mc.DataType.Name(value)


class EnsembleStep:
    """One ensemble step read out of the protobuf once, when the model is loaded (map access on a message
    costs per request)."""

    __slots__ = ("model", "version", "feed", "wanted", "out", "needs")

    def __init__(self, step: mc.ModelEnsembling.Step) -> None:
        self.model = step.model_name
        self.version = "" if step.model_version <= 0 else str(step.model_version)  # unset (0) or -1: latest
        self.feed = tuple(step.input_map.items())
        self.wanted = list(step.output_map)
        self.out = tuple(step.output_map.items())
        self.needs = frozenset(value for _, value in self.feed)

    def ready(self, pool: dict[str, np.ndarray]) -> bool:
        return pool.keys() >= self.needs


def plan_of(config: mc.ModelConfig) -> tuple[EnsembleStep, ...]:
    return tuple(EnsembleStep(s) for s in config.ensemble_scheduling.step)


async def run_ensemble(ensemble: str, plan: tuple[EnsembleStep, ...], inputs: dict[str, np.ndarray], wanted: list[str],
                       run_step: StepRunner) -> dict[str, np.ndarray]:
    pool = dict(inputs)
    await _run_steps(ensemble, list(plan), pool, run_step)
    return {name: pool[name] for name in wanted}


async def _run_steps(ensemble: str, waiting: list[EnsembleStep], pool: dict[str, np.ndarray],
                     run_step: StepRunner) -> None:
    """Every step of ``waiting``, each as soon as its inputs are in ``pool`` (independent ones at once),
    their outputs added to ``pool``."""
    running: dict[asyncio.Future, EnsembleStep] = {}
    try:
        while waiting or running:
            ready = [s for s in waiting if s.ready(pool)]
            if len(ready) == 1 and not running:
                # The common chain: one step can run and nothing else is in flight. Awaiting it directly is
                # the same schedule without a Task and a wait() per step.
                step = ready[0]
                waiting.remove(step)
                outputs = await run_step(step.model, step.version, {k: pool[v] for k, v in step.feed}, step.wanted)
                for key, value in step.out:
                    pool[value] = outputs[key]
                continue
            for step in ready:
                waiting.remove(step)
                task = asyncio.ensure_future(run_step(step.model, step.version, {k: pool[v] for k, v in step.feed},
                                                      step.wanted))
                running[task] = step
            if not running:
                raise Internal(f"ensemble '{ensemble}': steps {[s.model for s in waiting]} can never run")
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                step = running.pop(task)
                outputs = task.result()  # a failed step fails the ensemble request
                for key, value in step.out:
                    pool[value] = outputs[key]
    finally:
        for task in running:
            task.cancel()


# --- ensembles with a decoupled step ---------------------------------------------------------------------

def mark_decoupled(config: mc.ModelConfig, composing: Callable[[str], mc.ModelConfig]) -> None:
    """An ensemble with a decoupled step (or a nested ensemble that has one) is decoupled itself, as Triton
    makes it (its /config then says so): it answers over streams only, 0..n responses per request."""
    check_decoupled_origins(config, composing)
    if any(composing(s.model_name).model_transaction_policy.decoupled for s in config.ensemble_scheduling.step):
        config.model_transaction_policy.decoupled = True


def _after_decoupled(waiting: list[EnsembleStep], decoupled: Callable[[EnsembleStep], bool]) -> set[int]:
    """Indexes (in ``waiting``) of the decoupled steps and of every step that needs (directly or through other steps) a tensor
    one of them produces: these run once per response of the decoupled step before them."""
    tainted: set[str] = set()
    marked: set[int] = set()
    changed = True
    while changed:
        changed = False
        for i, step in enumerate(waiting):
            if i not in marked and (decoupled(step) or step.needs & tainted):
                marked.add(i)
                tainted.update(value for _, value in step.out)
                changed = True
    return marked


async def stream_ensemble(ensemble: str, plan: tuple[EnsembleStep, ...], inputs: dict[str, np.ndarray],
                          run_step: StepRunner, stream_step: StepStreamer, decoupled: Callable[[EnsembleStep], bool]
                          ) -> AsyncIterator[tuple[dict[str, np.ndarray], bool]]:
    """The tensors of an ensemble with decoupled steps, once per response that reaches its end, each with
    whether it is known to be the last: the steps that need no decoupled step's output run once, as
    :func:`run_ensemble` runs them; then each response of the first decoupled step carries its outputs down
    the steps after it (a copy of the tensors so far per response, so responses do not see each other's),
    which run once per response; a decoupled step among those streams again. A decoupled step that sends no
    response ends its branch with none (0..n). A decoupled step's responses are taken as they come (not
    when the steps after it are free): a response is the last when, as it leaves, every decoupled step
    above it has sent its final flag and no response of theirs waits -- as Triton marks it, so a client
    gets no empty final response after it."""
    async with contextlib.aclosing(_branches(ensemble, list(plan), dict(inputs), run_step, stream_step,
                                             decoupled)) as pools:
        async for pool, last in pools:
            yield pool, last


_END = object()


async def _branches(ensemble: str, waiting: list[EnsembleStep], pool: dict[str, np.ndarray], run_step: StepRunner,
                    stream_step: StepStreamer, decoupled: Callable[[EnsembleStep], bool]
                    ) -> AsyncIterator[tuple[dict[str, np.ndarray], bool]]:
    marked = _after_decoupled(waiting, decoupled)
    await _run_steps(ensemble, [s for i, s in enumerate(waiting) if i not in marked], pool, run_step)
    later = [s for i, s in enumerate(waiting) if i in marked]
    if not later:
        yield pool, True
        return
    first = next((s for s in later if decoupled(s) and s.ready(pool)), None)
    if first is None:
        raise Internal(f"ensemble '{ensemble}': steps {[s.model for s in later]} can never run")
    rest = [s for s in later if s is not first]
    responses: asyncio.Queue = asyncio.Queue()
    ended: list = []  # True once the step's stream ended; or its error, when it failed
    feeder = asyncio.ensure_future(_feed(stream_step(first.model, first.version, {k: pool[v] for k, v in first.feed},
                                                     first.wanted), responses, ended))
    try:
        while (outputs := await responses.get()) is not _END:
            if isinstance(outputs, BaseException):
                raise outputs
            branch = dict(pool)
            for key, value in first.out:
                if key in outputs:  # a response may leave an output out: a step needing it then cannot run
                    branch[value] = outputs[key]
            missing = [(s.model, sorted(s.needs - branch.keys())) for s in rest
                       if not s.needs <= branch.keys() | _made_by(rest, s)]
            if missing:
                model, names = missing[0]
                raise Internal(f"ensemble '{ensemble}': a response of decoupled step model '{first.model}' left out "
                               f"{names}, which step model '{model}' needs",
                               fix=f"make model '{first.model}' send every output its ensemble maps in each response")
            async with contextlib.aclosing(_branches(ensemble, list(rest), branch, run_step, stream_step,
                                                     decoupled)) as pools:
                async for done, last in pools:
                    if ended and ended[0] is not True:  # the step failed meanwhile: the request fails now, as
                        raise ended[0]                   # Triton's, its responses not yet sent dropped
                    # the last here too: the step's stream has ended and nothing of it waits
                    yield done, last and bool(ended) and responses.qsize() == 1
    finally:
        feeder.cancel()


async def _feed(responses: AsyncIterator[dict[str, np.ndarray]], into: asyncio.Queue, ended: list) -> None:
    """A decoupled step's responses into ``into`` as they come, then _END (``ended`` gets True) or the
    stream's error (in ``ended`` too)."""
    try:
        async with contextlib.aclosing(responses):
            async for outputs in responses:
                into.put_nowait(outputs)
    except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
        ended.append(exc)
        into.put_nowait(exc)
    else:
        ended.append(True)
        into.put_nowait(_END)


def _made_by(steps: list[EnsembleStep], but: EnsembleStep) -> set[str]:
    return {value for s in steps if s is not but for _, value in s.out}


def _wire(dtype: np.dtype) -> str:
    try:
        return cfg.numpy_to_wire(dtype)
    except ServeError:
        return str(dtype)


def step_request(model: str, version: str, feed: dict[str, np.ndarray], wanted: list[str],
                 request_id: str) -> InferRequest:
    """A step as a request of its own (a nested ensemble, a decoupled or a sequence model take the full
    request path); a step has its ensemble request's id, as Triton's."""
    return InferRequest(model_name=model, model_version=version,
                        inputs=[InferTensor(n, _wire(a.dtype), a.shape, a) for n, a in feed.items()],
                        outputs=[RequestedOutput(n) for n in wanted], id=request_id)


def step_item(model: LoadedModel, feed: dict[str, np.ndarray], wanted: list[str]) -> WorkItem:
    """The checks a client's request gets (serve/checks.py), on a step's arrays: the tensors come from the
    ensemble's checked inputs or an earlier step's outputs, but a composing model may have been reloaded
    with another config, so each is still held against the model's config."""
    inputs, batch = check_inputs(model, ((key, _wire(data.dtype), data.shape, data) for key, data in feed.items()))
    return WorkItem(inputs=inputs, outputs=check_outputs(model, wanted), batch_size=max(batch, 0))


def step_outputs(model: LoadedModel, item: WorkItem, outputs: dict[str, np.ndarray],
                 wanted: list[str]) -> dict[str, np.ndarray]:
    """The arrays a response would carry (TritonDataPlane._respond, less classification, which a step
    never asks for): config reshape applied, strings as BYTES' object arrays of bytes."""
    result = {}
    for name in wanted:
        array = outputs.get(name)
        if array is None:
            raise Internal(f"model '{model.name}' did not produce the requested output '{name}'")
        result[name] = output_array(model, item.batch_size, name, array)
    return result
