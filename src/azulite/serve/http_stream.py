"""Streamed HTTP/1.1 answers (chunked transfer encoding), mixed into the transport's connection class: a
reply whose body is an async iterator of byte chunks (the generate extension's server-sent events) is
written chunk by chunk as the iterator yields; the answers pipelined behind it wait until it ends."""

from __future__ import annotations

import asyncio
import logging

from azulite.serve.limits import close_soon

log = logging.getLogger("azulite.serve.http")


def is_stream(body) -> bool:
    return not isinstance(body, (bytes, bytearray, memoryview))


class StreamedReplies:
    """Needs of the connection: ``transport``, ``server`` (``in_flight``, ``limits``, ``check_idle``),
    ``streaming`` and ``_flush``."""

    __slots__ = ()

    def _write_stream(self, reply, keep_alive: bool, reasons: dict[int, bytes]) -> None:
        status, ctype, chunks, extra = reply
        head = [b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\nCache-Control: no-cache\r\n"
                % (status, reasons.get(status, b"Unknown"), ctype)]
        head += [b"%s: %s\r\n" % (k, v) for k, v in extra]
        if not keep_alive:
            head.append(b"Connection: close\r\n")
        self.transport.write(b"".join(head) + b"\r\n")
        self.streaming = True
        self.server.in_flight += 1  # a drain waits for the stream's end
        asyncio.ensure_future(self._pump(chunks, keep_alive))

    async def _pump(self, chunks, keep_alive: bool) -> None:
        complete = False
        try:
            async for chunk in chunks:
                if self.transport is None:  # the client went away
                    break
                if chunk:
                    self.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            else:
                complete = True
        except Exception:  # noqa: BLE001 - the head is sent: all that is left is to end the connection
            log.exception("HTTP: a streamed answer failed after it started")
        finally:
            if hasattr(chunks, "aclose"):
                await chunks.aclose()
            self.streaming = False
            self.server.in_flight -= 1
            if self.transport is not None:
                if complete:
                    self.transport.write(b"0\r\n\r\n")
                if not complete or not keep_alive or self.server.stopping:
                    close_soon(self.transport, self.server.limits)
                    self.transport = None
            self._flush()
            self.server.check_idle()
