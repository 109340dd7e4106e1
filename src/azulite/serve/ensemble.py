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
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import numpy as np

from azulite.errors import Internal, InvalidArgument, ModelLoadError, ServeError
from azulite.serve import config as cfg
from azulite.serve.backends.base import WorkItem
from azulite.serve.parameters import shape_text
from azulite.serve.proto import model_config_pb2 as mc

if TYPE_CHECKING:
    from azulite.serve.models import LoadedModel

StepRunner = Callable[[str, str, dict[str, np.ndarray], list[str]], Awaitable[dict[str, np.ndarray]]]


def check_ensemble(config: mc.ModelConfig, composing: Callable[[str], mc.ModelConfig]) -> None:
    """Every step's tensors exist on its model, every step input is produced, every output is made."""
    name = config.name
    available = {t.name for t in config.input}
    steps = list(config.ensemble_scheduling.step)
    produced: set[str] = set()
    for index, step in enumerate(steps):
        model = composing(step.model_name)
        model_inputs = {t.name for t in model.input}
        model_outputs = {t.name for t in model.output}
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
            produced.add(value)
    for index, step in enumerate(steps):
        for value in step.input_map.values():
            if value not in available and value not in produced:
                raise ModelLoadError(
                    f"ensemble '{name}' step {index}: input tensor '{value}' is neither an ensemble input nor "
                    "produced by any step"
                )
    for output in config.output:
        if output.name not in produced:
            raise ModelLoadError(f"ensemble '{name}': output '{output.name}' is not produced by any step")


class EnsembleStep:
    """One ensemble step read out of the protobuf once, when the model is loaded (map access on a message
    costs per request)."""

    __slots__ = ("model", "version", "feed", "wanted", "out")

    def __init__(self, step: mc.ModelEnsembling.Step) -> None:
        self.model = step.model_name
        self.version = "" if step.model_version <= 0 else str(step.model_version)  # unset (0) or -1: latest
        self.feed = tuple(step.input_map.items())
        self.wanted = list(step.output_map)
        self.out = tuple(step.output_map.items())

    def ready(self, pool: dict[str, np.ndarray]) -> bool:
        return all(value in pool for _, value in self.feed)


def plan_of(config: mc.ModelConfig) -> tuple[EnsembleStep, ...]:
    return tuple(EnsembleStep(s) for s in config.ensemble_scheduling.step)


async def run_ensemble(ensemble: str, plan: tuple[EnsembleStep, ...], inputs: dict[str, np.ndarray], wanted: list[str],
                       run_step: StepRunner) -> dict[str, np.ndarray]:
    pool = dict(inputs)
    waiting = list(plan)
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
    return {name: pool[name] for name in wanted}


def _wire(dtype: np.dtype) -> str:
    try:
        return cfg.numpy_to_wire(dtype)
    except ServeError:
        return str(dtype)


def step_item(model: LoadedModel, feed: dict[str, np.ndarray], wanted: list[str]) -> WorkItem:
    """The checks a client's request gets (TritonDataPlane._prepare), on a step's arrays: the tensors come
    from the ensemble's checked inputs or an earlier step's outputs, but a composing model may have been
    reloaded with another config, so each is still held against the model's config."""
    name = model.name
    mbs = model.max_batch_size
    batch = -1
    inputs: dict[str, np.ndarray] = {}
    for key, data in feed.items():
        spec = model.inputs.get(key)
        if spec is None:
            raise InvalidArgument(f"unexpected inference input '{key}' for model '{name}'",
                                  fix=f"the model's inputs are {sorted(model.inputs)}")
        if data.dtype != cfg.WIRE_TO_NUMPY.get(spec.datatype):
            raise InvalidArgument(f"inference input '{key}' data-type is '{_wire(data.dtype)}', "
                                  f"but model '{name}' expects '{spec.datatype}'")
        shape = data.shape
        if mbs > 0:
            if not shape:
                raise InvalidArgument(
                    f"unexpected shape for input '{key}' for model '{name}'. Expected "
                    f"{shape_text((-1, *spec.dims))}, got [] (the model batches: the first dimension is the batch)")
            if batch < 0:
                batch = shape[0]
            elif shape[0] != batch:
                raise InvalidArgument(f"input '{key}' has batch size {shape[0]} but other inputs of the request "
                                      f"have {batch}, for model '{name}'")
            rest = shape[1:]
        else:
            rest = shape
        if not spec.matches(rest):
            expected = (-1, *spec.dims) if mbs > 0 else spec.dims
            raise InvalidArgument(f"unexpected shape for input '{key}' for model '{name}'. "
                                  f"Expected {shape_text(expected)}, got {shape_text(shape)}")
        if spec.reshape is not None:
            data = data.reshape(((batch,) if mbs > 0 else ()) + spec.reshape)
        inputs[key] = data
    if not model.required_inputs <= inputs.keys():
        missing = sorted(model.required_inputs - inputs.keys())
        raise InvalidArgument(
            f"expected {len(model.required_inputs)} inputs but got {len(inputs)} inputs for model '{name}'. "
            f"Got input(s) {sorted(inputs)}, but missing required input(s) {missing}.")
    if mbs > 0 and batch == 0:
        raise InvalidArgument(f"inference request batch-size must be >= 1 for '{name}' (got a batch of 0)")
    if mbs > 0 and batch > mbs:
        raise InvalidArgument(f"inference request batch-size must be <= {mbs} for '{name}'",
                              fix=f"split the request into batches of at most {mbs}")
    for out in wanted:
        if out not in model.outputs:
            raise InvalidArgument(f"unexpected inference output '{out}' for model '{name}'",
                                  fix=f"the model's outputs are {sorted(model.outputs)}")
    return WorkItem(inputs=inputs, outputs=frozenset(wanted), batch_size=max(batch, 0))


def step_outputs(model: LoadedModel, item: WorkItem, outputs: dict[str, np.ndarray],
                 wanted: list[str]) -> dict[str, np.ndarray]:
    """The arrays a response would carry (TritonDataPlane._respond, less classification, which a step
    never asks for): config reshape applied, strings as BYTES' object arrays of bytes."""
    result = {}
    batched = model.max_batch_size > 0
    for name in wanted:
        array = outputs.get(name)
        if array is None:
            raise Internal(f"model '{model.name}' did not produce the requested output '{name}'")
        if not isinstance(array, np.ndarray):
            array = np.asarray(array)
        spec = model.outputs.get(name)
        if spec is not None and spec.reshape is not None:
            array = array.reshape(((item.batch_size,) if batched else ()) + spec.dims)
        if array.dtype.kind in ("S", "U"):
            array = np.array([s.encode() if isinstance(s, str) else bytes(s) for s in array.reshape(-1)],
                             dtype=np.object_).reshape(array.shape)
        result[name] = array
    return result
