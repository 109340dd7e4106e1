"""Warnings that azulite's own checkpoint calls provoke and that say nothing to a user, silenced for those
calls only.

DCP warns "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a
single process" on every save and load of a single-process run, which the Checkpointer asks for on purpose
(``no_dist=True``). ``warnings.catch_warnings`` would silence it by swapping the process's filter list,
which is not thread-safe, and an async save calls DCP on the Checkpointer's own thread while training goes
on: one filter is installed once instead, and it matches only in a thread that is inside
:func:`single_process_dcp`. Outside it (a script's own DCP calls, any other thread), the warning is as
torch gives it.
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
from collections.abc import Iterator

_inside = threading.local()
_lock = threading.Lock()
_SINGLE_PROCESS = re.compile(r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent "
                             r"is to (save|load) in a single process")


class _OnlyInside:
    """A warning filter's message pattern (the filter calls its ``match``) that matches only in a thread
    inside :func:`single_process_dcp`."""

    def match(self, text: str) -> bool:
        return getattr(_inside, "depth", 0) > 0 and _SINGLE_PROCESS.match(text) is not None


def _install() -> None:
    """Put the filter in, unless it is there (checked each time: a ``catch_warnings`` block it was put in
    under, pytest's around every test, takes it out again on leaving)."""
    with _lock:
        if any(isinstance(item[1], _OnlyInside) for item in warnings.filters):
            return
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS.pattern, category=UserWarning,
                                module=r"torch\.distributed\.checkpoint")
        # the same filter, its message pattern made thread-aware (filters are (action, message, category,
        # module, lineno); warnings calls message.match(text))
        for i, item in enumerate(warnings.filters):
            if item[0] == "ignore" and getattr(item[1], "pattern", None) == _SINGLE_PROCESS.pattern:
                warnings.filters[i] = (item[0], _OnlyInside(), *item[2:])
                break


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """A DCP save or load of one process (``no_dist=True``), asked for on purpose: without DCP's warning."""
    _install()
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1
