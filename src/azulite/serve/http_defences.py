"""The HTTP/1.1 transport's defences against hostile clients (see azulite.serve.limits), mixed into its
connection class: a request head that does not arrive in time (slowloris; the server's sweep calls
``_head_timeout``; a body that stops arriving, ``_body_timeout``), clients that do not read their answers (reading pauses, then the connection is
aborted), pipelining far ahead of the answers (reading pauses)."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("azulite.serve.http")


class HttpDefences:
    """Needs of the connection: ``transport``, ``server`` (``limits``, ``tick``), ``replies``, ``peer``,
    ``head_tick``, ``body_tick``, ``stall_timer``, ``read_paused``, ``write_paused``, ``deferred`` and ``_fail``."""

    __slots__ = ()

    def _head_timeout(self) -> None:
        if self.transport is not None:
            log.info("HTTP connection from %s closed: request head not complete in time", self.peer)
            self._fail(408, "the request head did not arrive in time")

    def _body_timeout(self) -> None:
        if self.transport is not None:
            log.info("HTTP connection from %s closed: request body stopped arriving", self.peer)
            self._fail(408, "the request body stopped arriving (no byte within --header-timeout-secs)")

    def pause_writing(self) -> None:
        self.write_paused = True
        self._reading()
        if self.stall_timer is None:
            self.stall_timer = asyncio.get_running_loop().call_later(self.server.limits.stall_timeout_s,
                                                                    self._stalled)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.stall_timer is not None:
            self.stall_timer.cancel()
            self.stall_timer = None
        self._reading()

    def _stalled(self) -> None:
        self.stall_timer = None
        if self.write_paused and self.transport is not None:
            log.info("HTTP connection from %s closed: its answers went unread", self.peer)
            self.transport.abort()

    def _reading(self) -> None:
        """Read while the client reads its answers and has few requests ahead of them."""
        if self.transport is None:
            return
        want = (not self.write_paused and not self.deferred
                and len(self.replies) < self.server.limits.max_pipelined)
        if want and self.read_paused:
            self.read_paused = False
            if self.head_tick >= 0:  # a head cut by our pause gets a whole timeout again
                self.head_tick = self.server.tick
            if self.body_tick >= 0:  # a body too
                self.body_tick = self.server.tick
            self.transport.resume_reading()
        elif not want and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()
