"""The HTTP/1.1 connection protocol itself (serve/http_server.py) on a real event loop and a real socket:
what one read holding many pipelined requests does, independent of how the kernel splits a client's bytes."""

from __future__ import annotations

import asyncio
import socket

from azulite.serve.http_server import HttpServer, _Connection
from azulite.serve.limits import ConnectionLimits


class _HeldApp:
    """Answers each request with its own path, once released: every request stays in flight until then."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def handle(self, method, path, headers, body, client=""):
        self.started += 1
        await self.release.wait()
        return 200, b"text/plain", path.encode(), ()


def test_one_read_of_many_pipelined_requests_runs_at_most_the_limit_and_answers_all_in_order():
    async def main():
        limits = ConnectionLimits(max_pipelined=8)
        app = _HeldApp()
        server = HttpServer(app, limits=limits)
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        transport, conn = await loop.connect_accepted_socket(lambda: _Connection(server), sock=ours)
        n = 50
        # one read that holds 50 requests: pause_reading cannot stop their parse, only the next read
        conn.data_received(b"".join(b"GET /r%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(n)))
        await asyncio.sleep(0)  # let the dispatched tasks start
        assert app.started == 8 and server.in_flight == 8 and len(conn.replies) == 8
        assert len(conn.deferred) == n - 8 and conn.read_paused
        app.release.set()
        reader, writer = await asyncio.open_connection(sock=theirs)
        paths = []
        while len(paths) < n:
            status = await reader.readline()
            assert status.startswith(b"HTTP/1.1 200"), status
            length = 0
            while (line := await reader.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            paths.append((await reader.readexactly(length)).decode())
        assert paths == [f"/r{i}" for i in range(n)]  # every request answered, in order
        assert app.started == n and not conn.deferred and not conn.read_paused  # reading resumed
        writer.close()
        transport.close()

    asyncio.run(main())
