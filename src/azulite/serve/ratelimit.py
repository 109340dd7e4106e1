"""Token buckets (requests per second, per key and per model) and daily quotas (per key), on an injected
clock so tests drive time themselves.

A bucket holds ``burst`` tokens and refills at ``rate`` per second; a request takes one or is refused
with the time until the next token (the Retry-After). Each take is one short critical section under a
lock, so N threads hammering one bucket still get exactly what the figure allows.

State lives in this process (item 10 of issue 11, several worker processes sharing one truth, is not
built): buckets and quota counters are keyed by the key id / model name only, so moving them into a
shared store (the key store's SQLite file, or shared memory) later changes this module alone.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Protocol

from azulite.errors import ResourceExhausted


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


class TokenBuckets:
    """Named buckets created on first use with ``rate`` and ``burst`` (default: one second's worth, at
    least 1). A bucket is a list [rate, burst, tokens, stamp]: this runs on every request."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or SystemClock()
        self._buckets: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def take(self, name: str, rate: float, burst: float | None = None) -> float:
        """One token from bucket ``name``: 0.0 when granted, else the seconds until one is due."""
        now = self.clock.monotonic()
        with self._lock:
            b = self._buckets.get(name)
            if b is None or b[0] != rate:
                size = burst if burst is not None else max(1.0, rate)
                b = self._buckets[name] = [rate, size, size, now]
                tokens = size
            else:
                tokens = b[2]
                if now > b[3]:
                    tokens = min(b[1], tokens + (now - b[3]) * rate)
                    b[3] = now
            if tokens >= 1.0:
                b[2] = tokens - 1.0
                return 0.0
            b[2] = tokens
            return (1.0 - tokens) / rate


class DailyQuotas:
    """Requests per key per UTC day (the day from ``clock.time()``)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or SystemClock()
        self._used: dict[str, tuple[int, int]] = {}  # key -> (day number, requests used that day)
        self._lock = threading.Lock()

    def take(self, name: str, per_day: int) -> float:
        """0.0 when within the quota, else the seconds until the next UTC midnight."""
        now = self.clock.time()
        day = int(now // 86400)
        with self._lock:
            used_day, used = self._used.get(name, (day, 0))
            if used_day != day:
                used = 0
            if used >= per_day:
                return (day + 1) * 86400 - now
            self._used[name] = (day, used + 1)
            return 0.0


def refuse(what: str, wait_s: float, fix: str) -> ResourceExhausted:
    """The 429 / RESOURCE_EXHAUSTED, with Retry-After rounded up to whole seconds (HTTP's unit)."""
    return ResourceExhausted(f"{what}; retry in {wait_s:.3g} s", retry_after_s=max(1, math.ceil(wait_s)), fix=fix)
