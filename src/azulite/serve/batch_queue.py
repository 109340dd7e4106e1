"""The pending requests of one model version and Triton's rule for which of them run together
(the batcher, serve/batcher.py, decides when and on which instance):

- ``priority_levels``: level 1 is served first; each level has its queue policy: ``max_queue_size``
  (over it: UNAVAILABLE "Exceeds maximum queue size"), ``default_timeout_microseconds`` (a request's own
  ``timeout`` counts only with ``allow_timeout_override``), ``timeout_action`` REJECT (fail it) or DELAY
  (serve it after every non-expired request of its level).
- Requests go together while their non-batch shapes match and their batch sizes sum to at most
  ``max_batch_size``. A batch leaves at once when full or when a prefix of the queue sums to a
  ``preferred_batch_size``; otherwise when the oldest request waited ``max_queue_delay_microseconds``.
- A model without ``dynamic_batching`` gets Triton's default scheduler: one request per execution.

A request is a deque entry and one future (under load this runs once per request on the event loop).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from azulite.errors import ServeError, Unavailable
from azulite.serve.backends.base import Result, WorkItem
from azulite.serve.batch_settings import BatcherSettings


class Rejected(Unavailable):
    """The scheduler refused or timed out the request (queue full, timeout REJECT): metrics count it
    as reason REJECTED."""


@dataclass(slots=True, eq=False)
class Pending:
    item: WorkItem
    shape_key: tuple
    future: asyncio.Future
    enqueued_ns: int
    deadline_ns: int
    level: int
    seq: int
    #: the answer's callback (Batcher.submit's ``then``), called inline when the batch answers
    then: Callable[[asyncio.Future], None] | None = None


def shape_key(item: WorkItem) -> tuple:
    """Requests batch together only if every input has the same shape past the batch dimension (in
    whatever order a client listed its inputs)."""
    skip = 1 if item.batch_size else 0
    if len(item.inputs) == 1:  # one input (an ensemble's parse step, most models): nothing to sort
        for name, array in item.inputs.items():
            return ((name, array.shape[skip:]),)
    return tuple(sorted((name, array.shape[skip:]) for name, array in item.inputs.items()))


@dataclass(slots=True)
class _Level:
    queue: deque = field(default_factory=deque)
    delayed: deque = field(default_factory=deque)


class BatchQueue:
    """Requests queued per priority level. ``queued(delta)`` is told every change of their number;
    ``expired(pending, error)`` answers a request its timeout (REJECT) took off the queue."""

    def __init__(self, *, model: str, settings: BatcherSettings, queued: Callable[[int], None],
                 expired: Callable[[Pending, Result | ServeError], None]) -> None:
        self.model = model
        self.settings = settings
        self._queued = queued
        self._expired = expired
        self._levels = [_Level() for _ in range(settings.priority_levels)]
        self.count = 0  # requests queued (all levels, normal + delayed)
        self.rows = 0  # their batch sizes summed
        self.with_deadline = 0  # queued requests that can time out
        self._seq = 0

    def push(self, item: WorkItem, future: asyncio.Future, *, priority: int = 0, timeout_us: int = 0) -> Pending:
        """Queue one request (Rejected when its level's queue is full)."""
        s = self.settings
        level = (priority if 0 < priority <= s.priority_levels else s.default_level) - 1
        policy = s.policies[level]
        lane = self._levels[level]
        if policy.max_queue_size and len(lane.queue) + len(lane.delayed) >= policy.max_queue_size:
            raise Rejected("Exceeds maximum queue size", where=f"model '{self.model}'")
        timeout = timeout_us if (policy.allow_timeout_override and timeout_us > 0) else policy.default_timeout_us
        now = time.monotonic_ns()
        pending = Pending(
            item=item,
            shape_key=shape_key(item) if s.dynamic else (),
            future=future,
            enqueued_ns=now,
            deadline_ns=now + timeout * 1000 if timeout else 0,
            level=level,
            seq=self._seq,
        )
        self._seq += 1
        lane.queue.append(pending)
        self.count += 1
        if pending.deadline_ns:
            self.with_deadline += 1
        self.rows += item.batch_size
        self._queued(item.requests)
        return pending

    def take_all(self) -> list[Pending]:
        """Every queued request, in the order they arrived, off the queue."""
        taken = sorted((p for lane in self._levels for p in (*lane.queue, *lane.delayed)), key=lambda p: p.seq)
        for lane in self._levels:
            lane.queue.clear()
            lane.delayed.clear()
        self._queued(-sum(p.item.requests for p in taken))
        self.count = self.rows = self.with_deadline = 0
        return taken

    def _order(self):
        """Requests in the order they are served: per level, the queue, then the delayed."""
        for lane in self._levels:
            yield from lane.queue
            yield from lane.delayed

    def _expire(self, now: int) -> int:
        """Apply timeouts; returns the nearest future deadline (0: none)."""
        nearest = 0
        for lane in self._levels:
            if not any(p.deadline_ns for p in lane.queue):
                continue
            keep: deque = deque()
            for p in lane.queue:
                if p.deadline_ns and p.deadline_ns <= now:
                    self.with_deadline -= 1
                    if self.settings.policies[p.level].delay_on_timeout:
                        p.deadline_ns = 0
                        lane.delayed.append(p)
                    else:
                        self.count -= 1
                        self.rows -= p.item.batch_size
                        self._queued(-p.item.requests)
                        self._expired(p, Rejected("Request timeout expired", where=f"model '{self.model}'"))
                else:
                    if p.deadline_ns and (not nearest or p.deadline_ns < nearest):
                        nearest = p.deadline_ns
                    keep.append(p)
            lane.queue = keep
        return nearest

    def choose(self, now: int, *, closing: bool = False) -> tuple[list[Pending] | None, int]:
        """The batch to run now (taken off the queues), or None and when to look again (0: when woken):
        nothing queued, or a batch still filling within max_queue_delay. ``closing``: whatever is queued
        leaves without waiting."""
        s = self.settings
        nearest = self._expire(now) if self.with_deadline else 0
        if self.count == 0:
            return None, nearest
        if not s.dynamic:
            batch = self._take(1)
            return (batch or None), 0
        # The longest prefix that fits: same shapes, batch sizes summing to <= max_batch_size. A request whose
        # caller is gone (its future cancelled: a reset, a deadline, a closed connection) is passed over, and
        # _take drops it: it does not run.
        n, total, best_preferred = 0, 0, 0
        head_key = None
        for p in self._order():
            if p.future.done():
                continue
            if head_key is None:
                head_key = p.shape_key
            elif p.shape_key != head_key:
                break
            if total + p.item.batch_size > s.max_batch_size and n:
                break
            n += 1
            total += p.item.batch_size
            if total in s.preferred:
                best_preferred = n
            if total >= s.max_batch_size:
                break
        if n == 0:  # every queued request's caller is gone
            self._take(self.count)
            return None, nearest
        full = total >= s.max_batch_size or n < self.count
        if full or closing:
            return self._take(n), 0
        if best_preferred:
            return self._take(best_preferred), 0
        head = next(self._order())
        due = head.enqueued_ns + s.max_delay_ns
        if now >= due:
            return self._take(n), 0
        return None, (min(due, nearest) if nearest else due)

    def _take(self, n: int) -> list[Pending]:
        """The first ``n`` live requests off the queues, in order; those whose caller is gone on the way
        are taken off too and answered (nothing reaches them; :meth:`choose` passed them over)."""
        batch: list[Pending] = []
        gone: list[Pending] = []
        for lane in self._levels:
            for q in (lane.queue, lane.delayed):
                while q and len(batch) < n:
                    p = q.popleft()
                    if p.deadline_ns:
                        self.with_deadline -= 1
                    (gone if p.future.done() else batch).append(p)
            if len(batch) == n:
                break
        taken = batch + gone if gone else batch
        self.count -= len(taken)
        self.rows -= sum(p.item.batch_size for p in taken)
        self._queued(-sum(p.item.requests for p in taken))
        for p in gone:  # settled already; with preserve_ordering its turn must still pass
            self._expired(p, Unavailable(f"model '{self.model}': the caller went away before the request ran"))
        return batch
