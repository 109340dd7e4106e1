"""Token buckets and daily quotas against an injected clock: the figure holds exactly, also when many
threads take at once (no wall time involved)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from azulite.serve.ratelimit import DailyQuotas, TokenBuckets, refuse


class FakeClock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return self.t


def test_bucket_grants_burst_then_rate():
    clock = FakeClock()
    b = TokenBuckets(clock)
    granted = sum(b.take("k", 10.0) == 0.0 for _ in range(100))
    assert granted == 10  # the burst: one second's worth
    wait = b.take("k", 10.0)
    assert abs(wait - 0.1) < 1e-9  # one token every 0.1 s
    clock.t += 0.35
    assert sum(b.take("k", 10.0) == 0.0 for _ in range(100)) == 3
    clock.t += 100.0  # idle: refills to the burst, never beyond
    assert sum(b.take("k", 10.0) == 0.0 for _ in range(100)) == 10


def test_bucket_holds_under_concurrent_requests_of_one_loop():
    """The server's concurrency: many requests interleaving on one event loop."""
    clock = FakeClock()
    b = TokenBuckets(clock)
    granted = []

    async def request():
        await asyncio.sleep(0)
        ok = b.take("shared", 20.0) == 0.0
        await asyncio.sleep(0)
        granted.append(ok)

    async def main():
        for _ in range(5):
            await asyncio.gather(*(request() for _ in range(500)))
            clock.t += 0.5  # half a second's refill between waves

    asyncio.run(main())
    assert sum(granted) == 20 + 4 * 10  # the burst, then 10 tokens per half second


def test_thread_safe_bucket_holds_under_threads():
    clock = FakeClock()
    b = TokenBuckets(clock, thread_safe=True)
    granted = []
    start = threading.Barrier(8)

    def hammer():
        start.wait()
        granted.append(sum(b.take("shared", 50.0) == 0.0 for _ in range(2000)))

    for step in range(5):
        threads = [threading.Thread(target=hammer) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        clock.t += 1.0
    # 5 rounds, each with a full bucket (50 at the start, 50 refilled per second after): exactly 250
    assert sum(granted) == 250


def test_buckets_are_independent_and_fractional_rates_work():
    clock = FakeClock()
    b = TokenBuckets(clock)
    assert b.take("a", 0.5) == 0.0
    assert b.take("a", 0.5) == 2.0  # one token per 2 s
    assert b.take("b", 0.5) == 0.0
    clock.t += 2.0
    assert b.take("a", 0.5) == 0.0


@pytest.mark.parametrize("thread_safe", [False, True])
def test_daily_quota_resets_at_utc_midnight(thread_safe):
    clock = FakeClock(86400 * 20000 + 86000.0)  # 400 s before a UTC midnight
    q = DailyQuotas(clock, thread_safe=thread_safe)
    assert [q.take("k", 3) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert q.take("k", 3) == 400.0
    assert q.take("other", 3) == 0.0
    clock.t += 400.0
    assert q.take("k", 3) == 0.0


def test_refusal_says_when_to_retry_in_whole_seconds():
    exc = refuse("over", 0.2, "slow down")
    assert exc.status == "RESOURCE_EXHAUSTED" and exc.retry_after_s == 1
    assert refuse("over", 7.01, "x").retry_after_s == 8


def test_planned_takes_answer_as_the_three_takes_do():
    """planned_take (the guard's hot path) against take_locked on twin buckets, over a seeded random walk
    of times across a UTC midnight: the same grants, the same refusal (which one, how long) every time."""
    import random

    from azulite.serve.ratelimit import planned_take

    rng = random.Random(11)
    now, wall = 500.0, 86400.0 * 3 - 2.0  # two seconds before a UTC midnight
    keys, quotas, models = TokenBuckets(), DailyQuotas(), TokenBuckets()
    twin_keys, twin_quotas, twin_models = TokenBuckets(), DailyQuotas(), TokenBuckets()
    key, quota, model = keys.bucket("k", 6.0, None, now), quotas.counter("k", wall), models.bucket("m", 4.0, None, now)
    planned = planned_take(key, quota, 40, model, lambda: wall, None, lambda which, wait: (which, wait))
    outcomes = set()
    for _ in range(3000):
        step = rng.choice((0.0, 0.0, 0.01, 0.05, 0.3))
        now, wall = now + step, wall + step
        got = planned(now) or (0, 0.0)
        takes = (lambda: twin_keys.take_locked("k", 6.0, None, now), lambda: twin_quotas.take_locked("k", 40, wall),
                 lambda: twin_models.take_locked("m", 4.0, None, now))
        want = (0, 0.0)
        for which, take in enumerate(takes, 1):  # in order; a refusal stops there, as the guard does
            wait = take()
            if wait:
                want = (which, wait)
                break
        assert got[0] == want[0] and got[1] == pytest.approx(want[1]), (now, wall)
        outcomes.add(got[0])
    assert outcomes == {0, 1, 2, 3}  # the walk reached every refusal, and a new day's quota


def test_planned_quota_follows_a_wall_clock_stepped_back_over_midnight():
    """planned_take keeps the quota's UTC day until the wall time leaves it: a clock stepped back over a
    midnight (NTP) counts in the earlier day again, as DailyQuotas.take_locked does."""
    from azulite.serve.ratelimit import planned_take

    midnight = 86400.0 * 5
    wall = midnight - 1.0
    quotas, twin = DailyQuotas(), DailyQuotas()
    planned = planned_take(None, quotas.counter("k", wall), 1, None, lambda: wall, None,
                           lambda which, wait: (which, wait))
    for wall in (midnight - 1.0, midnight + 1.0, midnight - 0.5, midnight + 2.0, midnight + 3.0):
        got = planned(0.0) or (0, 0.0)
        wait = twin.take_locked("k", 1, wall)
        assert got == ((2, wait) if wait else (0, 0.0)), wall
    assert got[0] == 2  # the last one: the quota of 1 used that day


@pytest.mark.parametrize("wait_s, said, header", [(0.25, "retry in 0.25 s", 1), (49_900, "retry in 13.9 h", 49_900),
                                                  (840, "retry in 14 min", 840)])
def test_the_wait_is_said_in_a_unit_a_person_reads(wait_s, said, header):
    err = refuse("quota spent", wait_s, "wait")
    assert said in err.message and err.retry_after_s == header  # was "retry in 4.99e+04 s"
