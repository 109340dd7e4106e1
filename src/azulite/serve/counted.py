"""A request's entry in its model's statistics and the server's in-flight count, for every path that
runs one (unary infer, an ensemble's step, a decoupled stream): success with its duration, or a failure
with Triton's reason — REJECTED (the scheduler refused it), the path's own for a ServeError (OTHER before
the model ran, BACKEND after), CANCELED, or OTHER for a bug of ours, answered as INTERNAL.

A hand-written context manager, not ``contextlib.contextmanager``: it runs on every request, and a
generator-based one costs several times more."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from azulite.errors import Internal, ServeError
from azulite.serve.batcher import Rejected

if TYPE_CHECKING:
    from azulite.serve.models import LoadedModel


class Counted:
    __slots__ = ("plane", "model", "start", "reason", "trace", "n")

    def __init__(self, plane: Any, model: LoadedModel, reason: str = "OTHER", n: int = 1) -> None:
        self.plane = plane  # anything with an ``_inflight`` count (the data plane)
        self.model = model
        self.reason = reason  # set to "BACKEND" once the request reached the model
        self.trace = None  # serve/trace.py: set when the request is traced; ended here
        self.n = n  # client requests it stands for (a front-end's coalesced requests: serve/coalesce.py)

    def __enter__(self) -> Counted:
        self.plane._inflight += 1
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        self.plane._inflight -= 1
        if self.trace is not None:
            self.trace.ended(kind is None)
        elapsed = time.perf_counter_ns() - self.start
        stats = self.model.stats
        n = self.n
        if kind is None:
            if n:
                stats.succeeded(elapsed, n)
        elif issubclass(kind, Rejected):
            stats.failed(elapsed, "REJECTED", n)
        elif issubclass(kind, ServeError):
            stats.failed(elapsed, self.reason, n)
        elif issubclass(kind, (asyncio.CancelledError, GeneratorExit)):
            stats.failed(elapsed, "CANCELED", n)
        elif issubclass(kind, Exception):  # a bug of ours: answer INTERNAL, keep serving
            stats.failed(elapsed, "OTHER", n)
            raise Internal(f"model '{self.model.name}': {kind.__name__}: {exc}") from exc
        return False
