"""The queue of pending requests on its own, with the clock passed in: which requests make a batch
(shapes, max_batch_size, preferred sizes, max_queue_delay), priority levels, timeouts and the queue
limit. The batcher's tests (test_batcher.py) drive the same rules through instances."""

from __future__ import annotations

import numpy as np
import pytest

from azulite.serve.backends.base import WorkItem
from azulite.serve.batch_queue import BatchQueue, Rejected
from azulite.serve.batch_settings import BatcherSettings, QueuePolicy


class Caller:
    """What the queue reads of a request's future: whether its caller is gone (``gone()`` cancels it)."""

    def __init__(self) -> None:
        self._done = False

    def done(self) -> bool:
        return self._done

    def gone(self) -> None:
        self._done = True


def item(value: float, rows: int = 1, width: int = 1) -> WorkItem:
    return WorkItem(inputs={"x": np.full((rows, width), value, np.float32)}, outputs=None, batch_size=rows)


def make(**kw) -> tuple[BatchQueue, list[int], list]:
    base = dict(max_batch_size=8, dynamic=True)
    base.update(kw)
    counted: list[int] = []
    expired: list = []
    q = BatchQueue(model="m", settings=BatcherSettings(**base), queued=counted.append,
                   expired=lambda p, error: expired.append((p.item.inputs["x"][0, 0], error)))
    return q, counted, expired


def values(batch) -> list[float]:
    return [float(p.item.inputs["x"][0, 0]) for p in batch]


def test_the_longest_prefix_of_one_shape_within_max_batch_size_leaves_at_once():
    q, counted, _ = make(max_delay_ns=10**12)
    for v, rows in ((1, 3), (2, 4), (3, 2)):  # 3 + 4 fit in 8; the third would not
        q.push(item(v, rows), Caller())
    batch, _ = q.choose(0)
    assert values(batch) == [1, 2] and (q.count, q.rows) == (1, 2)
    q.push(item(4, width=2), Caller())  # another shape behind it: the head's batch is complete at once
    batch, _ = q.choose(0)
    assert values(batch) == [3] and q.choose(0)[0] is None  # alone and not full: it waits
    assert values(q.choose(0, closing=True)[0]) == [4]
    assert sum(counted) == 0 and q.count == 0


def test_a_batch_that_is_not_full_waits_for_the_oldest_requests_delay():
    q, _, _ = make(max_delay_ns=5_000)
    head = q.push(item(1), Caller())
    q.push(item(2), Caller())
    batch, until = q.choose(head.enqueued_ns + 4_999)
    assert batch is None and until == head.enqueued_ns + 5_000 and q.count == 2
    batch, _ = q.choose(until)
    assert values(batch) == [1, 2]
    q.push(item(3), Caller())
    assert values(q.choose(0, closing=True)[0]) == [3]  # closing: nothing waits


def test_a_preferred_size_leaves_without_waiting():
    q, _, _ = make(max_delay_ns=10**12, preferred=(2,))
    for v in (1, 2, 3):
        q.push(item(v), Caller())
    assert values(q.choose(0)[0]) == [1, 2]
    assert q.choose(0)[0] is None


def test_without_dynamic_batching_one_request_per_batch():
    q, _, _ = make(dynamic=False)
    for v in (1, 2):
        q.push(item(v), Caller())
    assert values(q.choose(0)[0]) == [1] and values(q.choose(0)[0]) == [2]


def test_levels_queue_limit_timeouts_and_take_all_in_arrival_order():
    policies = (QueuePolicy(max_queue_size=1), QueuePolicy(default_timeout_us=1, delay_on_timeout=False),
                QueuePolicy(default_timeout_us=1, delay_on_timeout=True))
    q, counted, expired = make(max_batch_size=1, priority_levels=3, default_level=3, policies=policies)
    first = q.push(item(1), Caller())  # default level 3: times out, then waits behind its level (DELAY)
    q.push(item(2), Caller(), priority=2)  # times out: REJECT
    q.push(item(3), Caller(), priority=1)
    with pytest.raises(Rejected, match="Exceeds maximum queue size"):
        q.push(item(4), Caller(), priority=1)
    q.push(item(5), Caller(), priority=7)  # out of range: the default level
    late = first.enqueued_ns + 10**9
    assert values(q.choose(late)[0]) == [3]
    assert [(v, type(e)) for v, e in expired] == [(2.0, Rejected)] and "timeout" in str(expired[0][1])
    assert values(q.choose(late)[0]) == [1]  # level 3's two both delayed, in the order they expired
    q.push(item(6), Caller(), priority=1)
    assert values(q.take_all()) == [5, 6]  # what remains, as it arrived
    assert (q.count, q.rows, q.with_deadline) == (0, 0, 0) and sum(counted) == 0


def test_requests_whose_callers_are_gone_are_passed_over_and_taken_off_unrun():
    q, counted, expired = make(max_batch_size=3, max_delay_ns=10**12)
    callers = [Caller() for _ in range(5)]
    for v, caller in enumerate(callers, 1):
        q.push(item(v), caller)
    callers[0].gone()
    callers[2].gone()
    batch, _ = q.choose(0)  # the first three live ones fill the batch; the two gone ones go with them unrun
    assert values(batch) == [2, 4, 5] and q.count == 0 and sum(counted) == 0
    assert [v for v, _ in expired] == [1.0, 3.0] and all("went away" in str(e) for _, e in expired)
    for caller in [Caller(), Caller()]:
        q.push(item(9), caller)
        caller.gone()
    assert q.choose(0) == (None, 0) and q.count == 0 and sum(counted) == 0  # nothing left to run
