"""The sub-millisecond timer the batcher waits on (a Linux timerfd watched by the event loop)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import uvloop

from azulite.serve import finetimer
from azulite.serve.backends.base import Timing, WorkItem
from azulite.serve.batcher import Batcher, BatcherSettings

pytestmark = pytest.mark.skipif(finetimer._LIBC is None, reason="no timerfd (not Linux)")


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_it_fires_once_at_its_deadline_never_before_and_not_after_disarm(loop_factory):
    loop = loop_factory()
    try:
        async def main():
            fired: list[int] = []
            got = asyncio.Event()
            timer = finetimer.create(asyncio.get_running_loop(), lambda: (fired.append(time.monotonic_ns()), got.set()))
            assert timer is not None
            deadline = time.monotonic_ns() + 300_000  # 300 µs: under the loops' own timer resolution
            timer.arm(deadline)
            await asyncio.wait_for(got.wait(), 30)
            assert len(fired) == 1 and fired[0] >= deadline
            got.clear()
            timer.arm(time.monotonic_ns() - 1)  # already past: at once
            await asyncio.wait_for(got.wait(), 30)
            assert len(fired) == 2
            timer.arm(time.monotonic_ns() + 1_000)
            timer.disarm()
            while time.monotonic_ns() < deadline + 2_000_000:  # its deadline passes while the loop is busy
                pass
            await asyncio.sleep(0.01)  # the loop polls: a disarmed timer has nothing to run
            assert len(fired) == 2
            timer.close()
            timer.close()  # twice: nothing
            with pytest.raises(RuntimeError):
                timer.arm(time.monotonic_ns())

        loop.run_until_complete(main())
    finally:
        loop.close()


class Instant:
    """y = x, recorded with the time each batch started."""

    def __init__(self) -> None:
        self.started: list[int] = []

    def execute(self, items: list[WorkItem]):
        self.started.append(time.monotonic_ns())
        return [dict(i.inputs) for i in items], Timing(1, 2, 3)

    def close(self) -> None:
        pass


def test_a_sub_millisecond_delay_waits_without_spinning_the_loop():
    """One request and a 900 µs max_queue_delay: the batch leaves no earlier than its due time, and the
    scheduler looks at the queue twice (when the request came, when the timer fired) — waiting a loop pass
    at a time looked dozens of times (fails)."""

    async def main():
        model = Instant()
        bt = Batcher(model="m", settings=BatcherSettings(max_batch_size=8, dynamic=True, max_delay_ns=900_000),
                     instances=[("i", model)])
        looks = 0
        choose = bt._choose

        def counting(now):
            nonlocal looks
            looks += 1
            return choose(now)

        bt._choose = counting
        t0 = time.monotonic_ns()
        out = await asyncio.wait_for(bt.submit(WorkItem(inputs={"x": np.ones((1, 1), np.float32)}, outputs=None,
                                                        batch_size=1)), 30)
        assert out["x"].shape == (1, 1)
        assert model.started[0] - t0 >= 900_000
        assert looks <= 3, looks
        await bt.close()
        assert bt._fine is None

    asyncio.run(main())
