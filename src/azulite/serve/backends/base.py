"""The backend boundary: a backend loads one instance of one model version and executes a batch of
requests on it. The scheduler never knows which backend it drives; a backend never knows about queues,
transports or metrics.

A backend is registered by name (the name Triton's config uses: ``onnxruntime``, ``pytorch``,
``python``) in a registry that refuses duplicates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from azulite.errors import ModelLoadError, ServeError
from azulite.serve.proto import model_config_pb2 as mc


@dataclass(slots=True)
class WorkItem:
    """One request as a backend sees it. ``batch_size`` is the size of the leading dimension of every
    input (0 for a model without batching); ``outputs`` the requested output names (None: all)."""

    inputs: dict[str, np.ndarray]
    outputs: frozenset[str] | None
    batch_size: int
    request_id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    # Decoupled models (serve/decoupled.py): sink(result, final) takes each response, from any thread,
    # before or after execute returns; None for models that answer once per request.
    sink: Callable[[Result | None, bool], None] | None = None
    # serve/trace.py: the request's trace when the tracer sampled it (the batcher stamps its compute times)
    trace: Any = None
    # serve/coalesce.py: the client requests a front-end coalesced into this one, [(id, rows)] in row order
    # (None: one request), and how many (what statistics count)
    parts: list[tuple[str, int]] | None = None
    requests: int = 1


@dataclass(slots=True)
class Timing:
    """Nanoseconds spent preparing inputs, running the model, and collecting outputs for one batch."""

    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0


Result = dict[str, np.ndarray] | ServeError


class ModelInstance(Protocol):
    """One loaded instance. ``execute`` runs in the instance's own thread; it returns one result per
    item (outputs or a per-request error) or raises to fail the whole batch.

    ``inline_safe``: execute may also run on the server's event loop thread (it never waits on the
    server itself, as a Python model's BLS call or its own event loop would); the batcher does so for a
    single-instance model whose executions are short (see :mod:`azulite.serve.batcher`): short in CPU
    time, unless the instance sets ``inline_by_wall`` (its execute waits on another process), then in
    wall time."""

    inline_safe: bool

    def execute(self, items: list[WorkItem]) -> tuple[list[Result], Timing]: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class LoadContext:
    """What a backend gets to load one instance."""

    model_name: str
    version: int
    model_dir: Path  # <repository>/<model>
    model_file: Path
    config: mc.ModelConfig
    instance_name: str
    instance_index: int
    # Runs a pb_utils.InferenceRequest on this server from a model's thread (Python BLS); None: no BLS.
    bls: Callable[[Any], Any] | None = None
    # Threads one execution may use inside the math libraries (ONNX Runtime intra-op, torch); None:
    # the library's default.
    compute_threads: int | None = None


class Backend(Protocol):
    name: str

    def auto_complete(self, config: mc.ModelConfig, model_file: Path) -> mc.ModelConfig:
        """Fill what the model file tells (inputs, outputs, batching) into a partial config."""
        ...

    def load(self, ctx: LoadContext) -> ModelInstance: ...


_REGISTRY: dict[str, Callable[[], Backend]] = {}


def register(name: str) -> Callable[[Callable[[], Backend]], Callable[[], Backend]]:
    def decorator(factory: Callable[[], Backend]) -> Callable[[], Backend]:
        if name in _REGISTRY:
            raise ValueError(f"backend '{name}' is registered twice")
        _REGISTRY[name] = factory
        return factory

    return decorator


def get_backend(name: str) -> Backend:
    if not _REGISTRY:
        # Import for the side effect of registering; late so importing azulite.serve stays light.
        from azulite.serve.backends import onnxruntime, python, torchscript  # noqa: F401
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ModelLoadError(
            f"backend '{name}' is not available (available: {', '.join(sorted(_REGISTRY))})"
        ) from None
