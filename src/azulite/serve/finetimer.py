"""A one-shot event-loop timer with the kernel's resolution (Linux ``timerfd``), for waits under a millisecond.

asyncio's and uvloop's timers have millisecond resolution (asyncio rounds a 100 µs delay up to 1 ms,
uvloop fires it at once), so the batcher waited out a sub-millisecond ``max_queue_delay_microseconds``
by yielding one loop pass at a time: a busy wait, ~100 µs of the loop's CPU for every batch that had to
wait (at c=1 with Triton's usual 100 µs: every request), taken from the instances and the clients on the
same cores. A ``timerfd`` armed at the deadline and watched by the loop wakes it once, with nothing run
before. ``os.timerfd_create`` arrives only in Python 3.13, hence ``ctypes`` on libc (Linux >= 2.6.25);
:func:`create` answers None elsewhere, and the caller keeps its loop-pass wait.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

CLOCK_MONOTONIC = 1  # time.monotonic_ns's clock on Linux
TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


class FineTimer:
    """``arm(deadline_ns)`` (``time.monotonic_ns`` clock) calls ``callback`` on the loop once the deadline
    passed (at once for one already past); arming again replaces the deadline; ``disarm`` cancels one not
    yet run (a wake that was already on its way is dropped: settime clears the pending expirations)."""

    def __init__(self, loop, fd: int, callback: Callable[[], None]) -> None:
        self._loop = loop
        self._fd = fd
        self._callback = callback
        self._spec = _Itimerspec()
        self._armed = False
        loop.add_reader(fd, self._fired)

    def arm(self, deadline_ns: int) -> None:
        if self._fd < 0:
            raise RuntimeError("the timer is closed")
        value = self._spec.it_value
        value.tv_sec, value.tv_nsec = divmod(max(1, deadline_ns), 1_000_000_000)
        self._settime()
        self._armed = True

    def disarm(self) -> None:
        if self._armed and self._fd >= 0:
            self._spec.it_value.tv_sec = self._spec.it_value.tv_nsec = 0
            self._settime()
            self._armed = False

    def _settime(self) -> None:
        if _LIBC.timerfd_settime(self._fd, TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")

    def _fired(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:  # disarmed after it became readable: nothing to run
            return
        self._armed = False
        self._callback()

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            self._loop.remove_reader(self._fd)
        except (RuntimeError, ValueError, OSError):  # the loop is closed: nothing watches it any more
            pass
        os.close(self._fd)
        self._fd = -1


def create(loop, callback: Callable[[], None]) -> FineTimer | None:
    """A timer on ``loop``, or None where the kernel or libc offers no timerfd."""
    if _LIBC is None:
        return None
    fd = _LIBC.timerfd_create(CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        return None
    return FineTimer(loop, fd, callback)
