"""The HTTP/2 transport's defences against hostile clients (see azulite.serve.limits), mixed into its
connection class: the preface timeout (slowloris), flow-control and unread-socket stalls, control-frame
answers piling up unread. Kept apart so the protocol code reads as the protocol."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("azulite.serve.grpc")


class H2Defences:
    """Needs of the connection: ``transport``, ``limits``, ``settled``, ``streams``, ``blocked``,
    ``last_progress``, ``stall_timer``, ``head_timer``, ``write_paused``, ``peer`` and ``_goaway``."""

    __slots__ = ()

    def _head_timeout(self) -> None:
        self.head_timer = None
        if not self.settled:
            self._goaway(0xB, "no connection preface and SETTINGS in time")

    def _arm_stall_timer(self) -> None:
        if self.stall_timer is None and self.transport is not None:
            self.stall_timer = asyncio.get_running_loop().call_later(self.limits.stall_timeout_s, self._check_stall)

    def _check_stall(self) -> None:
        """Answers blocked by flow control, or a socket the client does not read, with no progress for
        stall_timeout_s: the client holds our memory without reading it; close."""
        self.stall_timer = None
        if self.transport is None:
            return
        stuck = self.write_paused or any(s.sid in self.streams and s.out for s in self.blocked)
        if not stuck:
            return
        idle = asyncio.get_running_loop().time() - self.last_progress
        if idle >= self.limits.stall_timeout_s * 0.999:
            log.info("gRPC connection from %s closed: no flow-control progress for %.0f s", self.peer, idle)
            self._goaway(0xB, "flow control stalled")
            if self.transport is not None:
                self.transport.abort()
        else:
            self.stall_timer = asyncio.get_running_loop().call_later(self.limits.stall_timeout_s - idle,
                                                                    self._check_stall)

    def _check_write_buffer(self) -> None:
        if self.transport is not None and self.transport.get_write_buffer_size() > self.limits.max_write_buffer:
            self.transport.abort()  # answers to control frames pile up unread: a flood

    def pause_writing(self) -> None:
        """The client does not read: stop reading its requests until it does (bounded memory)."""
        self.write_paused = True
        self.last_progress = asyncio.get_running_loop().time()
        if self.transport is not None:
            self.transport.pause_reading()
        self._arm_stall_timer()

    def resume_writing(self) -> None:
        self.write_paused = False
        self.last_progress = asyncio.get_running_loop().time()
        if self.transport is not None:
            self.transport.resume_reading()
