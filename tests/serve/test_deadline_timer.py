"""The microsecond deadline timer (a timerfd the event loop watches) on asyncio's and uvloop's loops, and the
batcher waiting out a sub-millisecond max_queue_delay on it without spinning the loop."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
import uvloop

from azulite.serve import batcher as batcher_module
from azulite.serve import deadline_timer
from azulite.serve.backends.base import Timing, WorkItem
from azulite.serve.batch_settings import BatcherSettings
from azulite.serve.batcher import Batcher

pytestmark = pytest.mark.skipif(deadline_timer._TIMERFD is None, reason="no timerfd on this platform")

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run(factory, coro_fn):
    loop = factory()
    try:
        return loop.run_until_complete(coro_fn())
    finally:
        loop.close()


@pytest.mark.parametrize("loop_name", LOOPS)
def test_fires_once_and_never_before_its_deadline(loop_name):
    async def main():
        loop = asyncio.get_running_loop()
        fired: list[int] = []
        done = loop.create_future()

        def callback():
            fired.append(time.monotonic_ns())
            done.done() or done.set_result(None)

        timer = deadline_timer.create(loop, callback)
        assert timer is not None
        deadlines = []
        for delay_ns in (200_000, 0, -5_000_000):  # ahead, now, already passed (fires at once)
            done = loop.create_future()
            deadline = time.monotonic_ns() + delay_ns
            deadlines.append(deadline)
            timer.arm(deadline)
            await asyncio.wait_for(done, 30)
        # a later pass must not bring a second call for any of them
        for _ in range(5):
            await asyncio.sleep(0)
        timer.close()
        return fired, deadlines

    fired, deadlines = run(LOOPS[loop_name], main)
    assert len(fired) == 3, fired
    assert all(f >= d for f, d in zip(fired, deadlines)), (fired, deadlines)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_rearming_replaces_the_deadline_and_disarm_cancels_one_that_already_expired(loop_name):
    async def main():
        loop = asyncio.get_running_loop()
        calls = {"a": 0, "b": 0}
        b_fired = loop.create_future()
        a = deadline_timer.create(loop, lambda: calls.__setitem__("a", calls["a"] + 1))
        b = deadline_timer.create(loop, lambda: (calls.__setitem__("b", calls["b"] + 1), b_fired.done()
                                                 or b_fired.set_result(None)))
        a.arm(time.monotonic_ns() + 3600 * 10**9)  # an hour away ...
        a.arm(1)  # ... replaced by one long passed: the kernel has expired it before the loop polls again
        a.disarm()  # and it is cancelled all the same (the loop may still see the fd ready: read finds nothing)
        b.arm(time.monotonic_ns() + 1_000_000)
        await asyncio.wait_for(b_fired, 30)  # the loop has polled since: a fire of a's would have run by now
        for _ in range(5):
            await asyncio.sleep(0)
        a.close()
        b.close()
        return calls

    assert run(LOOPS[loop_name], main) == {"a": 0, "b": 1}


def test_close_stops_watching_and_later_use_is_refused_or_harmless():
    async def main():
        loop = asyncio.get_running_loop()
        timer = deadline_timer.create(loop, lambda: None)
        fd = timer._fd
        timer.arm(time.monotonic_ns() + 3600 * 10**9)
        timer.close()
        timer.close()  # twice: no error
        timer.disarm()  # after close (a sleep cancelled by an unload): no error, no write to a reused fd
        with pytest.raises(RuntimeError, match="after close"):
            timer.arm(1)
        return fd

    fd = run(asyncio.new_event_loop, main)
    with pytest.raises(OSError):  # the descriptor is closed
        os.fstat(fd)


class Doubler:
    def execute(self, items: list[WorkItem]):
        return [{"y": i.inputs["x"] * 2} for i in items], Timing(1, 2, 3)

    def close(self) -> None:
        pass


class QueueTimes:
    def __init__(self) -> None:
        self.queue_ns: list[int] = []

    def queued(self, delta: int) -> None:
        pass

    def executed(self, batch_size, queue_ns, timing, ok) -> None:
        self.queue_ns.extend(queue_ns)


@pytest.mark.parametrize("timerfd", [True, False], ids=["timerfd", "no-timerfd"])
@pytest.mark.parametrize("loop_name", LOOPS)
def test_the_batcher_waits_a_sub_millisecond_delay_out_asleep_but_its_last_stretch(monkeypatch, loop_name, timerfd):
    """A lone request waits the whole max_queue_delay (900 us here). With a timerfd the scheduler sleeps
    through all of it but the last SPIN_NS in one wait; it used to yield one loop pass at a time, spinning a
    core for the whole delay, as a platform without timerfd still does: that way must keep the delay too."""
    if not timerfd:
        monkeypatch.setattr(deadline_timer, "_TIMERFD", None)
    waits: list[int] = []  # per wait for a deadline: how long was left of it
    original = Batcher._sleep_until_woken

    async def counted(self, until_ns):
        if until_ns:
            waits.append(until_ns - time.monotonic_ns())
        await original(self, until_ns)

    monkeypatch.setattr(Batcher, "_sleep_until_woken", counted)

    async def main():
        observer = QueueTimes()
        batcher = Batcher(model="m", settings=BatcherSettings(max_batch_size=8, dynamic=True, max_delay_ns=900_000),
                          instances=[("i0", Doubler())], observer=observer)
        results = []
        for value in (1.0, 2.0, 3.0):
            waits.clear()
            out = await asyncio.wait_for(batcher.submit(WorkItem(
                inputs={"x": np.full((1, 1), value, np.float32)}, outputs=None, batch_size=1)), 30)
            results.append((float(out["y"][0, 0]), sum(left >= batcher_module.SPIN_NS for left in waits)))
        await batcher.close()
        return results, observer.queue_ns

    results, queue_ns = run(LOOPS[loop_name], main)
    assert [r[0] for r in results] == [2.0, 4.0, 6.0]
    assert all(q >= 900_000 for q in queue_ns), queue_ns  # the delay is kept, never cut short
    if timerfd:
        # at most one wait asleep until the last stretch: the timer cannot fire early, and nothing else wakes a
        # lone request's delay (polling, the same 900 us took ~190 passes before the last 100 us). None when the
        # loop reached the wait with less than SPIN_NS left (a loaded machine: CI saw [1, 1] with one 0), which
        # then polls as it should: that is no failure of the timer
        assert all(r[1] <= 1 for r in results), results
