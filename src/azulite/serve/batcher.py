"""The scheduler of one model version: it flushes a batch of pending requests (serve/batch_queue.py: which
requests go together, priorities, timeouts) to an idle instance on size or deadline, with Triton's
dynamic-batching semantics.

- A batch is formed only when an instance is idle, so under load requests pile up and batches grow.
- An inline batch (run on the loop itself) that is not full, after a batch that merged several requests,
  first lets the loop run ``GATHER_PASSES`` passes, so requests already read join it.
- ``preserve_ordering``: responses are released in the order the requests arrived.
- A batch that fails fails every request in it.

The merge/split of tensors is not here (merge.py, used by the backends), nor the settings read from a
config (batch_settings.py) or an instance's thread (instance_thread.py); this module only decides when
and where requests run. Everything runs on the event loop; only ``execute`` runs in the
instance's own thread, except the short executions of a single-instance model whose backend allows it,
which run on the loop too (``INLINE_MAX_NS``).

The hand-offs are the cheapest the loop offers, because under load they happen once per batch: a request
is a deque entry and one future; the scheduler is one task that wakes on a future and runs (or posts) a
batch itself, with no task per batch; a batch goes to its instance's long-lived thread through a
``SimpleQueue`` and comes back as one ``call_soon_threadsafe`` that answers every request of it (no
executor future, no chained asyncio future, no asyncio.Queue of idle instances).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from azulite.errors import Internal, ServeError, Unavailable
from azulite.serve import coalesce, deadline_timer
from azulite.serve.backends.base import ModelInstance, Result, Timing, WorkItem
from azulite.serve.batch_queue import BatchQueue, Pending, Rejected
from azulite.serve.batch_settings import BatcherSettings
from azulite.serve.instance_thread import InstanceThread, timed_execute

log = logging.getLogger(__name__)

__all__ = ["Batcher", "NullObserver", "Observer", "Rejected"]  # Rejected: its old home, where the server imports it

#: A single-instance model whose executions take less than this CPU time (moving average) runs them on the
#: event loop itself: handing a short batch to the instance's thread and its answer back costs more than
#: the batch (bench model at concurrency 8: 6.8k -> 11.5k infer/s), and a thread running Python beside the
#: loop trades the GIL with it at every numpy call (DLRM's parse: more CPU per row, less throughput).
#: Longer ones keep their thread, so the loop never stalls for long; the average follows the model, inline
#: or not. CPU time, not wall time: on a loaded machine the wall clock of the same batch stretches several
#: fold, which used to push a short model off the loop exactly when the hand-off cost most.
INLINE_MAX_NS = 500_000
#: ... and whose executions also take less than this in wall-clock time: a model that waits (sleeps, I/O,
#: compute in threads of its own) rather than computes keeps its thread however little CPU it uses.
INLINE_MAX_WALL_NS = 4 * INLINE_MAX_NS
#: A model kept off the loop by the wall-clock guard alone runs one batch in this many on the loop again,
#: and that batch's wall time replaces the average (see Batcher._inline).
PROBE_EVERY = 64
#: The last stretch of a queue delay (max_queue_delay_microseconds) is waited out one loop pass at a time, the
#: rest asleep on a timerfd (serve/deadline_timer.py). Asleep all through, a delay of 100 us left the core
#: idle, and the batch that followed ran cold, on this 2-core VM: bench_matmul HTTP c=1 1.10x Triton's
#: throughput against 1.42x (stop 22), gil_py c=1 0.93-0.96x (stop 30); a timer's wake-up lands p50 30-36 us,
#: p90 57-78 us late here (stop 30), which this covers. Polling all through, a longer delay spun a core for
#: its whole length: at 500 requests/s with a 900 us delay, 1.32-1.43 ms of server CPU per inference, against
#: 0.59-0.66 ms this way (bench_matmul HTTP, stop 35; docs/perf-serving.md).
SPIN_NS = 100_000
#: batches over which the server must have held one request at a time for a short delay to be skipped
#: (Batcher._alone)
PEAK_BATCHES = 64
#: An inline batch blocks the loop, so other connections' requests wait in their sockets and, once read,
#: reach this queue a loop pass later: chosen at once, the next batch holds whatever happened to be queued
#: (DLRM, 1 row per request, HTTP c=32: ~6 rows) and pays the batch's fixed cost for few rows. After a batch
#: that merged several requests, a batch that is not full first lets the loop run this many passes (two:
#: uvloop resumes the scheduler before the handlers of the same poll), then more while the queue still
#: grows, up to GATHER_MAX_PASSES. Measured: README, DLRM serving.
GATHER_PASSES = 2
GATHER_MAX_PASSES = 8


class Observer(Protocol):
    """What the batcher reports (statistics and metrics live elsewhere)."""

    def queued(self, delta: int) -> None: ...

    def executed(self, batch_size: int, queue_ns: Sequence[int], timing: Timing, ok: bool) -> None: ...


class NullObserver:
    def queued(self, delta: int) -> None:
        pass

    def executed(self, batch_size: int, queue_ns: Sequence[int], timing: Timing, ok: bool) -> None:
        pass


class Batcher:
    #: set once the server traces (serve/trace.py): a batch's traced requests then get its compute times
    trace_on = False

    def __init__(
        self,
        *,
        model: str,
        settings: BatcherSettings,
        instances: Sequence[tuple[str, ModelInstance]],
        observer: Observer | None = None,
        server_in_flight: Callable[[], int] | None = None,
    ) -> None:
        self.model = model
        # the server's requests in flight, every model's (the data plane's count; None: not known): when they
        # are all this batcher's, a batch need not wait out max_queue_delay for others (_alone)
        self.server_in_flight = server_in_flight
        self.settings = settings
        self.observer = observer or NullObserver()
        self._instances = [InstanceThread(name, m) for name, m in instances]
        # one instance (nothing to run concurrently) whose backend allows it: short executions run inline
        self._may_inline = len(instances) == 1 and bool(getattr(instances[0][1], "inline_safe", False))
        # its execute sees requests (a Python model): a coalesced request reaches it as its parts
        self._per_request = bool(instances) and bool(getattr(instances[0][1], "per_request", False))
        self._exec_ns: float | None = None  # moving average of execute()'s own time (no hand-off)
        self._exec_cpu_ns = 0.0  # the same, CPU time of the thread that ran it
        self._off_loop = 0  # batches the wall-clock guard alone sent to the thread since the last probe
        self._probe = False  # the batch running inline now is a probe
        # an instance whose execute waits on something else (its process) is measured by the wall clock alone
        self._by_wall = bool(instances) and bool(getattr(instances[0][1], "inline_by_wall", False))
        self._queue = BatchQueue(model=model, settings=settings, queued=self.observer.queued, expired=self._complete)
        self._delaying = False  # the scheduler sleeps out max_queue_delay for a batch to fill
        self._next_release = 0
        self._finished: dict[int, tuple[Pending, Result | ServeError]] = {}
        self._inflight = 0
        self._running = 0  # requests in the batches running now (_alone)
        # the most requests the server held at once when one was submitted, in this window of PEAK_BATCHES
        # batches and in the one before (_alone)
        self._peak = self._peak_before = self._peak_batches = 0
        self._last_requests = 0  # requests in the last batch dispatched (GATHER_PASSES)
        self._closing = False
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: deque[InstanceThread] = deque(self._instances)
        self._waker: asyncio.Future | None = None
        self._timer: deadline_timer.DeadlineTimer | None = None  # the queue delay's, from _start
        self._drained: asyncio.Event | None = None

    # --- the front door ---------------------------------------------------------------------------

    def submit(self, item: WorkItem, *, priority: int = 0, timeout_us: int = 0,
               then: Callable[[asyncio.Future], None] | None = None) -> asyncio.Future:
        """Queue one request; the future resolves to its outputs or raises its ServeError. ``then(future)``:
        called once the future is done, inline where the batch is answered (not a loop pass later, as a done
        callback of the future would be: see :meth:`_settle`), or as its done callback when it is cancelled."""
        if self._closing:
            raise Unavailable(f"model '{self.model}' is unloading or the server is shutting down")
        if self._task is None:
            self._start()
        s = self.settings
        if self.server_in_flight is not None and (held := self.server_in_flight()) > self._peak:
            self._peak = held
        pending = self._queue.push(item, self._loop.create_future(),  # type: ignore[union-attr]
                                   priority=priority, timeout_us=timeout_us)
        if then is not None:
            pending.then = then
            pending.future.add_done_callback(then)  # a cancel (the client went away) still reaches it
        # While the scheduler sleeps out max_queue_delay, a request that cannot complete a batch need
        # not wake it (the timer will): saves a scheduler pass per request under load.
        # With every instance busy the scheduler waits for one, and the one finishing wakes it.
        if self._idle and (not self._delaying or s.preferred or self._queue.rows >= s.max_batch_size
                           or pending.deadline_ns):
            self._wake()
        return pending.future

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let the queued and running ones finish (up to the timeout), fail the
        rest, then finalize every instance."""
        self._closing = True
        if self._task is not None:
            self._wake()
            assert self._drained is not None
            if self._queue.count or self._inflight:
                try:
                    await asyncio.wait_for(self._drained.wait(), drain_timeout_s)
                except asyncio.TimeoutError:
                    pass
            self._task.cancel()
            self._fail_queued(Unavailable(f"model '{self.model}' was unloaded before the request ran"))
        self._close_timer()
        loop = asyncio.get_running_loop()
        for inst in self._instances:
            closed = loop.create_future()
            # in the instance's own thread, after its last batch (as Triton finalizes an instance)
            inst.post(loop, inst.model.close, (), lambda _, error, f=closed: f.done() or f.set_result(error))
            error = await closed
            inst.stop()
            if error is not None:
                raise error

    def close_now(self) -> None:
        """Finalize without an event loop (a model that never served a request, or interpreter exit)."""
        self._closing = True
        self._close_timer()
        for inst in self._instances:
            inst.model.close()
            inst.stop()

    def _close_timer(self) -> None:
        if self._timer is not None:
            self._timer.close()
            self._timer = None

    @property
    def queued(self) -> int:
        return self._queue.count

    # --- the scheduler ----------------------------------------------------------------------------

    def _start(self) -> None:
        self._drained = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._timer = deadline_timer.create(self._loop, self._wake)
        self._task = self._loop.create_task(self._run(), name=f"batcher-{self.model}")

    def _wake(self) -> None:
        waker = self._waker
        if waker is not None and not waker.done():
            waker.set_result(None)

    async def _sleep_until_woken(self, until_ns: int) -> None:
        """Wait for a wake-up (a request, an idle instance) or for ``until_ns`` (0: none): asleep on the
        deadline timer up to its last ``SPIN_NS``, which is waited out one loop pass at a time."""
        timer = self._timer
        if until_ns and until_ns - time.monotonic_ns() < (SPIN_NS if timer is not None else 1_000_000):
            # Without a timerfd (not Linux) for all of a sub-millisecond delay: event-loop timers have
            # millisecond resolution (asyncio rounds up to 1 ms, uvloop fires at once). A pass serves I/O.
            await asyncio.sleep(0)
            return
        # the loop _start kept, not asyncio.get_running_loop(): Python 3.11 checks it with a getpid() system
        # call each time, and at c=1 this runs twice a request
        loop = self._loop
        self._waker = waker = loop.create_future()  # type: ignore[union-attr]
        handle = None
        if until_ns:
            if timer is not None:  # to the microsecond, the loop asleep in its poll meanwhile (deadline_timer.py)
                timer.arm(until_ns - SPIN_NS)
            else:
                delay = max(0.0, (until_ns - time.monotonic_ns()) / 1e9)
                handle = loop.call_later(delay, lambda: waker.done() or waker.set_result(None))
        try:
            await waker
        finally:
            self._waker = None
            if handle is not None:
                handle.cancel()
            elif timer is not None:
                timer.disarm()  # woken before the deadline (a request, an idle instance): no stale fire

    async def _run(self) -> None:
        while True:
            try:
                batch = await self._next_batch()  # returns with an instance idle (no await between)
            except Exception as exc:  # a scheduler bug must not leave requests waiting forever
                self._fail_queued(Internal(f"model '{self.model}': scheduler error {type(exc).__name__}: {exc}"))
                continue
            self._dispatch(self._idle.popleft(), batch)

    def _fail_queued(self, error: ServeError) -> None:
        for pending in self._queue.take_all():  # through _complete: with preserve_ordering, errors too are answered in order
            self._complete(pending, error)

    async def _next_batch(self) -> list[Pending]:
        gathered, seen, alone = 0, 0, False
        while True:
            if not self._idle:  # every instance busy (or a finishing one took the batch): one wakes it
                await self._sleep_until_woken(0)
                continue
            if (gathered < GATHER_PASSES or (gathered < GATHER_MAX_PASSES and self._queue.count > seen)) and self._gathers():
                gathered += 1
                seen = self._queue.count
                await asyncio.sleep(0)
                continue
            batch, until = self._queue.choose(time.monotonic_ns(), closing=self._closing)
            if batch is not None:
                return batch
            if self._queue.count == 0:
                if self._closing and self._inflight == 0:
                    self._drained.set()  # type: ignore[union-attr]
                await self._sleep_until_woken(until)
                continue
            if self._alone():
                # Every request the server holds is queued or running here: within a delay this short only a
                # request not yet read could join. After one more loop pass (requests read in this one are
                # submitted in it) the batch leaves at once instead of the loop waiting out the delay busy
                # (~100 µs of CPU a request at concurrency 1: docs/perf-workers.md, stops 23 and 44).
                if alone:
                    batch, _ = self._queue.choose(time.monotonic_ns(), closing=True)
                    if batch is not None:
                        return batch
                alone = True
                await asyncio.sleep(0)
                continue
            self._delaying = True
            try:
                await self._sleep_until_woken(until)
            finally:
                self._delaying = False

    def _alone(self) -> bool:
        """Whether nothing the server holds besides this batcher's queued and running requests could join a
        batch (``server_in_flight``: the data plane's count of requests in flight, every model's) and the
        server has held one request at a time lately (PEAK_BATCHES): a closed-loop client alone, whose next
        request cannot come before this one's answer. With more clients, the one answered a moment ago may be
        sending its next request, which the delay exists to catch (dispatched at once, gil_py's batches at
        c=8 shrank from 3.1 to 2.85 rows and its throughput fell 7%). Only for a queue delay short enough to
        be waited out busy (<= SPIN_NS): a longer one is the config's request to wait, and is waited asleep."""
        return (self.server_in_flight is not None and self.settings.dynamic and not self._closing
                and 0 < self.settings.max_delay_ns <= SPIN_NS and max(self._peak, self._peak_before) <= 1
                and self.server_in_flight() <= self._queue.count + self._running)

    def _gathers(self) -> bool:
        """Whether to let the loop run a pass before choosing the batch (see GATHER_PASSES)."""
        return (self._last_requests > 1 and 0 < self._queue.rows < self.settings.max_batch_size and self.settings.dynamic
                and self._may_inline and self._exec_ns is not None and self._exec_cpu_ns < INLINE_MAX_NS
                and not self._by_wall and not self._closing)

    def _dispatch(self, inst: InstanceThread, batch: list[Pending]) -> None:
        """Run the batch inline on the loop (short executions of a single instance), send it to its
        instance process from the loop, or post it to the instance's thread; each way :meth:`_finish`
        answers it."""
        self._inflight += 1
        self._running += len(batch)
        self._peak_batches += 1
        if self._peak_batches >= PEAK_BATCHES:
            self._peak_before, self._peak, self._peak_batches = self._peak, 0, 0
        self._last_requests = len(batch)
        start = time.monotonic_ns()
        items = [p.item for p in batch]
        counts = None
        if self._per_request:  # a Python model's execute sees each client request (serve/coalesce.py)
            items, counts = coalesce.expand(items, self.model)
        if self._inline():
            try:
                outcome, error = timed_execute(inst.model, items), None
            except Exception as exc:  # noqa: BLE001 - _finish fails the batch
                outcome, error = None, exc
            self._finish(inst, batch, start, outcome, error, counts=counts)
        elif (start_batch := getattr(inst.model, "start_batch", None)) is not None:
            # an instance process: sent from the loop and answered by a reader callback, no thread between
            # (ProcessInstance.start_batch has the A/B); its wall time is what the inline rule reads for it
            t0 = time.perf_counter_ns()
            try:
                start_batch(self._loop, items, lambda outcome, error: self._finish(
                    inst, batch, start, None if outcome is None else (*outcome, time.perf_counter_ns() - t0, 0),
                    error, chain=True, counts=counts))
            except Exception as exc:  # noqa: BLE001 - e.g. inputs it cannot pack: _finish fails the batch
                self._finish(inst, batch, start, None, exc)
        else:
            inst.post(self._loop, timed_execute, (inst.model, items),  # type: ignore[arg-type]
                      lambda outcome, error: self._finish(inst, batch, start, outcome, error, chain=True,
                                                          counts=counts))

    def _inline(self) -> bool:
        if not self._may_inline or self._exec_ns is None:
            return False
        if self._by_wall:
            return self._exec_ns < INLINE_MAX_NS
        if self._exec_cpu_ns >= INLINE_MAX_NS:
            return False
        if self._exec_ns < INLINE_MAX_WALL_NS:
            return True
        # Short in CPU, long in wall time: a model that waits (it keeps its thread), or a short one whose wall
        # clock a loaded machine stretched -- and on its thread, waiting for the GIL stretches it further, so
        # the average alone would never bring it back. Now and then one batch runs on the loop to tell which.
        self._off_loop += 1
        if self._off_loop < PROBE_EVERY:
            return False
        self._off_loop = 0
        self._probe = True
        return True

    def _finish(self, inst: InstanceThread, batch: list[Pending], start: int, outcome, failure: BaseException | None,
                *, chain: bool = False, counts: list[int] | None = None) -> None:
        """Answer a batch. ``chain``: called back by an instance (its process's answer read by the loop,
        or its thread's result posted), which then gets its next batch here at once when one is ready:
        the scheduler task, woken instead, would run only after every other I/O callback of this loop pass
        (parsing other connections' requests meanwhile, with the instance idle). Never for inline batches
        (the scheduler is the caller) nor while closing (the scheduler drains)."""
        self._inflight -= 1
        self._running -= len(batch)
        self._idle.append(inst)
        if chain and self._queue.count and not self._may_inline and not self._closing:
            batch_next, _ = self._queue.choose(time.monotonic_ns())
            if batch_next is not None:
                self._dispatch(self._idle.popleft(), batch_next)
        self._wake()
        error: ServeError | None = None
        results: list[Result] = []
        timing = Timing()
        if failure is None:
            results, timing, took, cpu = outcome
            # the model's own time, not the hand-off's: that is what inline execution would block the loop for
            if self._exec_ns is None or self._probe:
                self._exec_ns, self._exec_cpu_ns = took, cpu
                self._probe = False
            else:
                self._exec_ns = 0.8 * self._exec_ns + 0.2 * took
                self._exec_cpu_ns = 0.8 * self._exec_cpu_ns + 0.2 * cpu
            expected = len(batch) if counts is None else sum(counts)
            if len(results) != expected:
                error = Internal(f"model '{self.model}': {len(results)} results for {expected} requests")
            elif counts is not None:  # a coalesced request's parts' results as one again
                results = coalesce.regroup(results, [p.item for p in batch], counts)
        elif isinstance(failure, ServeError):
            error = failure
        else:  # a backend bug: fail the batch, keep serving
            error = Internal(f"model '{self.model}': {type(failure).__name__}: {failure}")
        batch_size = sum(p.item.batch_size for p in batch) or 1
        queue_ns = [start - p.enqueued_ns for p in batch]
        if any(p.item.requests != 1 for p in batch):  # statistics count client requests (serve/coalesce.py)
            queue_ns = [q for p, q in zip(batch, queue_ns) for _ in range(p.item.requests)]
        self.observer.executed(batch_size, queue_ns, timing, error is None)
        if Batcher.trace_on:
            end = time.monotonic_ns()
            for p in batch:
                if p.item.trace is not None:
                    p.item.trace.computed(p.enqueued_ns, start, timing.input_ns, timing.output_ns, end)
        if error is not None:
            for p in batch:
                self._complete(p, error)
        else:
            for p, result in zip(batch, results):
                self._complete(p, result)
        if self._closing and self._queue.count == 0 and self._inflight == 0:
            self._drained.set()  # type: ignore[union-attr]

    # --- answers ----------------------------------------------------------------------------------

    def _complete(self, pending: Pending, result: Result | ServeError) -> None:
        if not self.settings.preserve_ordering:
            self._settle(pending, result)
            return
        self._finished[pending.seq] = (pending, result)
        while self._next_release in self._finished:
            p, r = self._finished.pop(self._next_release)
            self._settle(p, r)
            self._next_release += 1

    def _settle(self, pending: Pending, result: Result | ServeError) -> None:
        future = pending.future
        if future.done():  # the client went away
            return
        then = pending.then
        if then is not None:  # answered here, not by the future's done callback a loop pass later
            future.remove_done_callback(then)
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
        if then is not None:
            try:
                then(future)
            except Exception:  # noqa: BLE001 - one answer's failure must not stop the batch's others
                log.exception("model '%s': answering a request failed", self.model)
