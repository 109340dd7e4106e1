"""A model instance's own thread for the batcher: one job at a time from a SimpleQueue, each outcome
posted back to the event loop with one ``call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable

from azulite.serve.backends.base import ModelInstance, Result, Timing, WorkItem


def timed_execute(model: ModelInstance, items: list[WorkItem]) -> tuple[list[Result], Timing, int, int]:
    """``model.execute(items)`` with its wall and CPU time (ns) in whichever thread runs it: the batcher
    keeps a model inline on the loop or on its thread by these."""
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    results, timing = model.execute(items)
    return results, timing, time.perf_counter_ns() - t0, time.thread_time_ns() - c0


class InstanceThread:
    """A model instance and its own thread, started on first use: it runs one job at a time from a
    SimpleQueue and posts each outcome back to the loop with one ``call_soon_threadsafe``."""

    __slots__ = ("model", "name", "_jobs", "_thread")

    def __init__(self, name: str, model: ModelInstance) -> None:
        self.model = model
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable, args: tuple,
             done: Callable[[object, BaseException | None], None]) -> None:
        """Run ``fn(*args)`` in the instance's thread; then ``done(result, None)`` or ``done(None, exc)``
        on the loop."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=f"azulite-{self.name}", daemon=True)
            self._thread.start()
        self._jobs.put((loop, fn, args, done))

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, fn, args, done = job
            try:
                outcome, error = fn(*args), None
            except BaseException as exc:  # noqa: BLE001 - the loop decides what a failure means
                outcome, error = None, exc
            try:
                loop.call_soon_threadsafe(done, outcome, error)
            except RuntimeError:  # the loop is closed (interpreter exit): nobody waits for the answer
                pass

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None
