"""Token buckets and daily quotas against an injected clock: the figure holds exactly, also when many
threads take at once (no wall time involved)."""

from __future__ import annotations

import threading

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


def test_bucket_holds_under_concurrency():
    clock = FakeClock()
    b = TokenBuckets(clock)
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


def test_daily_quota_resets_at_utc_midnight():
    clock = FakeClock(86400 * 20000 + 86000.0)  # 400 s before a UTC midnight
    q = DailyQuotas(clock)
    assert [q.take("k", 3) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert q.take("k", 3) == 400.0
    assert q.take("other", 3) == 0.0
    clock.t += 400.0
    assert q.take("k", 3) == 0.0


def test_refusal_says_when_to_retry_in_whole_seconds():
    exc = refuse("over", 0.2, "slow down")
    assert exc.status == "RESOURCE_EXHAUSTED" and exc.retry_after_s == 1
    assert refuse("over", 7.01, "x").retry_after_s == 8
