"""A one-shot timer with the kernel's precision for an event loop: a Linux timerfd the loop watches.

asyncio's and uvloop's timers have millisecond resolution (asyncio rounds a delay up to the next
millisecond of its poll, uvloop rounds it to whole milliseconds), too coarse for Triton's
``max_queue_delay_microseconds``. The batcher used to wait out a sub-millisecond delay one loop pass at a
time: exact, but it spins a core for the whole delay (a 900 us delay at 500 requests/s: twice the server's
CPU per inference). A timerfd armed with an absolute deadline on CLOCK_MONOTONIC (``time.monotonic_ns``'s
clock) wakes the loop's own poll at that microsecond, with nothing running meanwhile; unlike a poll's
timeout, a timerfd is not stretched by the thread's timer slack. (How much of a delay the batcher still
spins, and why: ``SPIN_NS`` in serve/batcher.py.)

The standard library has timerfd from Python 3.13 (``os.timerfd_create``); before it, the same two libc
calls through ctypes. Where there is neither (not Linux), :func:`create` returns None and the caller
keeps its old way.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from collections.abc import Callable

__all__ = ["DeadlineTimer", "create"]

_CLOCK_MONOTONIC = 1  # what time.monotonic_ns() reads on Linux
_TFD_NONBLOCK = 0o4000
_TFD_CLOEXEC = 0o2000000
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc_timerfd() -> tuple[Callable[[], int], Callable[[int, int], None]] | None:
    """timerfd_create and an absolute timerfd_settime in nanoseconds, from the stdlib or libc; None: neither."""
    if hasattr(os, "timerfd_create"):  # Python 3.13+
        flags = os.TFD_NONBLOCK | os.TFD_CLOEXEC

        def settime(fd: int, deadline_ns: int) -> None:
            os.timerfd_settime_ns(fd, flags=os.TFD_TIMER_ABSTIME, initial=deadline_ns)

        return (lambda: os.timerfd_create(time.CLOCK_MONOTONIC, flags=flags)), settime
    if not hasattr(os, "sched_getaffinity"):  # not Linux: no timerfd
        return None
    try:
        # the process's own symbols, libc's among them: find_library("c") would run ldconfig in a subprocess
        # (3.7 ms) at the import of every server process
        libc = ctypes.CDLL(None, use_errno=True)
        c_create, c_settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    c_create.argtypes, c_create.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    c_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
    c_settime.restype = ctypes.c_int
    spec = _Itimerspec()  # reused: one event loop thread arms a timer at a time

    def create_fd() -> int:
        fd = c_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_create: {os.strerror(err)}")
        return fd

    def settime_fd(fd: int, deadline_ns: int) -> None:
        spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(deadline_ns, 1_000_000_000)
        if c_settime(fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")

    return create_fd, settime_fd


_TIMERFD = _libc_timerfd()


class DeadlineTimer:
    """Calls ``callback`` on ``loop`` once ``time.monotonic_ns()`` reaches the deadline last :meth:`arm`-ed.
    One deadline at a time: arming again replaces it; :meth:`disarm` cancels it. A fire the loop had already
    seen ready when the deadline was replaced may still call back once: callers re-check their own state."""

    __slots__ = ("_callback", "_fd", "_loop", "_settime", "armed")

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None], create_fd, settime) -> None:
        self._fd = create_fd()
        self._loop, self._callback, self._settime = loop, callback, settime
        self.armed = False
        try:
            loop.add_reader(self._fd, self._fired)
        except BaseException:
            os.close(self._fd)
            raise

    def arm(self, deadline_ns: int) -> None:
        if self._fd < 0:
            raise RuntimeError("DeadlineTimer.arm after close")
        self._settime(self._fd, max(1, deadline_ns))  # 0 would disarm; a deadline passed fires at once
        self.armed = True

    def disarm(self) -> None:
        if self.armed and self._fd >= 0:  # closed (a model unloaded mid-sleep): nothing to disarm
            self._settime(self._fd, 0)
            self.armed = False

    def _fired(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:  # re-armed or disarmed after the loop saw it ready: not a fire
            return
        self.armed = False
        self._callback()

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            self._loop.remove_reader(self._fd)
        except (RuntimeError, ValueError):  # the loop is closed already: nothing watches the fd any more
            pass
        os.close(self._fd)
        self._fd = -1


def create(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> DeadlineTimer | None:
    """A timer on ``loop``, or None where the platform has no timerfd (or the process is out of fds: the
    caller's millisecond timers still work)."""
    if _TIMERFD is None:
        return None
    try:
        return DeadlineTimer(loop, callback, *_TIMERFD)
    except OSError:
        return None
