"""Token buckets (requests per second, per key and per model) and daily quotas (per key), on an injected
clock so tests drive time themselves.

A bucket holds ``burst`` tokens and refills at ``rate`` per second; a request takes one or is refused
with the time until the next token (the Retry-After). A take never awaits, so the concurrent requests of
the server's event loop cannot interleave inside one; with ``thread_safe=True`` it is a critical section
under a lock, so N threads hammering one bucket still get exactly what the figure allows.

State lives in this process: the server's choice with one worker. The worker processes of one server
share theirs through serve/sharedstate.py (same ``take`` and ``take_locked``, same answers).
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
    least 1). A bucket is a list [rate, burst, tokens, stamp]: this runs on every request.

    ``thread_safe=False`` (the server's choice): every caller runs on the server's event loop thread
    (HTTP, HTTP/2 and grpc.aio all do), where a take, having no await, is atomic with respect to the
    concurrent requests; a lock would cost a microsecond a take for nothing. ``True`` for callers on
    several threads."""

    def __init__(self, clock: Clock | None = None, *, thread_safe: bool = False) -> None:
        self.clock = clock or SystemClock()
        self._buckets: dict[str, list[float]] = {}
        self._lock = threading.Lock() if thread_safe else None

    def take(self, name: str, rate: float, burst: float | None = None, now: float | None = None) -> float:
        """One token from bucket ``name``: 0.0 when granted, else the seconds until one is due. ``now``:
        the clock's monotonic() when the caller already read it."""
        if now is None:
            now = self.clock.monotonic()
        if self._lock is None:
            return self._take(name, rate, burst, now)
        with self._lock:
            return self._take(name, rate, burst, now)

    def _take(self, name: str, rate: float, burst: float | None, now: float) -> float:
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

    #: ``take`` without the thread lock, ``now`` given: for a caller that holds it or runs on the event
    #: loop (the guard: its key bucket, quota and model bucket, as sharedstate.py's under one flock)
    take_locked = _take

    def bucket(self, name: str, rate: float, burst: float | None, now: float) -> list[float]:
        """The bucket ``take_locked(name, rate, burst, now)`` draws from (made if new): for
        :func:`planned_take`, which draws from it directly."""
        b = self._buckets.get(name)
        if b is None or b[0] != rate:
            size = burst if burst is not None else max(1.0, rate)
            b = self._buckets[name] = [rate, size, size, now]
        return b


class DailyQuotas:
    """Requests per key per UTC day (the day from ``clock.time()``). ``thread_safe`` as TokenBuckets."""

    def __init__(self, clock: Clock | None = None, *, thread_safe: bool = False) -> None:
        self.clock = clock or SystemClock()
        self._used: dict[str, tuple[int, int]] = {}  # key -> (day number, requests used that day)
        self._lock = threading.Lock() if thread_safe else None

    def take(self, name: str, per_day: int, now: float | None = None) -> float:
        """0.0 when within the quota, else the seconds until the next UTC midnight. ``now``: the clock's
        time() when the caller already read it."""
        if now is None:
            now = self.clock.time()
        if self._lock is None:
            return self._take(name, per_day, now)
        with self._lock:
            return self._take(name, per_day, now)

    def _take(self, name: str, per_day: int, now: float) -> float:
        day = int(now // 86400)
        used = self._used.get(name)
        if used is None:
            used = self._used[name] = [day, 0]
        elif used[0] != day:
            used[0], used[1] = day, 0
        if used[1] >= per_day:
            return (day + 1) * 86400 - now
        used[1] += 1
        return 0.0

    take_locked = _take  #: as TokenBuckets.take_locked

    def read(self, name: str) -> tuple[int, int]:
        """(day, requests used that day) of ``name``'s counter ((-1, 0) if none)."""
        used = self._used.get(name)
        return (-1, 0) if used is None else (used[0], used[1])

    def seed(self, name: str, day: int, used: int) -> None:
        """At least ``used`` requests of ``day`` counted for ``name`` (a restart's ledger, serve/quota_ledger.py)."""
        counter = self._used.get(name)
        if counter is None or counter[0] != day:
            self._used[name] = [day, used]
        elif counter[1] < used:
            counter[1] = used

    def counter(self, name: str, now: float) -> list[int]:
        """The [day, used] pair ``take_locked(name, ...)`` counts in (made if new), for :func:`planned_take`."""
        used = self._used.get(name)
        if used is None:
            used = self._used[name] = [int(now // 86400), 0]
        return used


def planned_take(key: list[float] | None, quota: list[int] | None, per_day: int, model: list[float] | None,
                 wall_clock, expires: float | None, refused):
    """The per-request part of a guard's plan as one closure ``take(now)``: a key's bucket, its daily
    quota and a model's bucket (each None when it has none; from ``bucket`` and ``counter``) taken in
    that order, as three ``take_locked`` calls would, with the same arithmetic as TokenBuckets._take and
    DailyQuotas._take. ``take`` answers False when granted, True when the key's ``expires`` (wall time)
    has passed, and ``refused(which, wait)``'s answer (it may raise) on a refusal — which: 1 the key's
    bucket, 2 its quota, 3 the model's bucket —, what was taken before the refusal staying taken.
    ``wall_clock()`` is read only when a quota or an expiry needs it. One closure over the objects it
    needs, no lookups or argument unpacking: this runs on every guarded request. The quota's UTC day is
    computed again only when the wall time leaves the day last computed ([lo, hi)): one compare instead
    of a float division and an ``int()`` call per request (~60 ns of the take's ~450, hot)."""
    day, lo, hi = 0, 0.0, -1.0  # the day of wall times in [lo, hi): none yet

    def take(now: float):
        nonlocal day, lo, hi
        if expires is not None or quota is not None:
            wall = wall_clock()
            if expires is not None and wall >= expires:
                return True
        if key is not None:
            tokens = key[2]
            if now > key[3]:
                tokens += (now - key[3]) * key[0]
                if tokens > key[1]:  # min() without the call
                    tokens = key[1]
                key[3] = now
            if tokens < 1.0:
                key[2] = tokens
                return refused(1, (1.0 - tokens) / key[0])
            key[2] = tokens - 1.0
        if quota is not None:
            if wall >= hi or wall < lo:  # another day than the last request's (or the first request)
                day = int(wall // 86400)
                lo = day * 86400.0
                hi = lo + 86400.0
            if quota[0] != day:  # a new day, or another path (a full check) counted in another day
                quota[0], quota[1] = day, 0
            if quota[1] >= per_day:
                return refused(2, hi - wall)
            quota[1] += 1
        if model is not None:
            tokens = model[2]
            if now > model[3]:
                tokens += (now - model[3]) * model[0]
                if tokens > model[1]:
                    tokens = model[1]
                model[3] = now
            if tokens < 1.0:
                model[2] = tokens
                return refused(3, (1.0 - tokens) / model[0])
            model[2] = tokens - 1.0
        return False

    return take


def refuse(what: str, wait_s: float, fix: str) -> ResourceExhausted:
    """The 429 / RESOURCE_EXHAUSTED, with Retry-After rounded up to whole seconds (HTTP's unit)."""
    return ResourceExhausted(f"{what}; retry in {_wait(wait_s)}", retry_after_s=max(1, math.ceil(wait_s)), fix=fix)


def _wait(seconds: float) -> str:
    """3.2 s, 14 min, 13.9 h: not 4.99e+04 s."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
