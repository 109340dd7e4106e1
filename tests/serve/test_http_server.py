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


class _TableApp:
    """Answers each path with the reply the test put in its table, at once or after one suspension."""

    def __init__(self, table) -> None:
        self.table = table

    async def handle(self, method, path, headers, body, client=""):
        if path.startswith("/later"):
            await asyncio.sleep(0)
        return self.table[path.rsplit("/", 1)[-1]]


def _expected(status, reason, ctype, body, extra, keep_alive):
    """The answer's bytes, spelled out here rather than by the code under test."""
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (status, reason, ctype, len(body))
    head += b"".join(b"%s: %s\r\n" % kv for kv in extra)
    return head + (b"" if keep_alive else b"Connection: close\r\n") + b"\r\n" + bytes(body)


def test_answers_are_byte_exact_on_every_way_out():
    """The answer head comes from a cached prefix and the done callback writes a lone keep-alive answer
    itself: every mix of status, content type, extra headers, body size (one write or two), body type,
    keep-alive or close, answered at once or after a suspension, alone or pipelined, is the same bytes."""
    big = bytes(range(256)) * 300  # past the 64 KiB single-write limit
    table = {
        "ok": (200, b"application/json", b'{"a":1}', ()),
        "bin": (200, b"application/octet-stream", b"\x00\x01binary",
                ((b"Inference-Header-Content-Length", b"2"), (b"X-Two", b"y"))),
        "missing": (404, b"application/json", b'{"error":"no"}', ()),
        "busy": (503, b"application/json", b"{}", ((b"Retry-After", b"1"),)),
        "odd": (299, b"text/plain", b"", ()),
        "big": (200, b"application/octet-stream", big, ()),
        "ba": (200, b"text/plain", bytearray(b"from a bytearray"), ()),
    }
    reasons = {200: b"OK", 404: b"Not Found", 503: b"Service Unavailable", 299: b"Unknown"}

    async def main():
        server = HttpServer(_TableApp(table))
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        transport, conn = await loop.connect_accepted_socket(lambda: _Connection(server), sock=ours)
        reader, writer = await asyncio.open_connection(sock=theirs)
        for later in ("", "/later"):
            for name, (status, ctype, body, extra) in table.items():
                for keep_alive in (True, False):
                    for repeat in range(2):  # the second one takes the cached head
                        if not keep_alive and repeat:
                            continue
                        close = b"" if keep_alive else b"Connection: close\r\n"
                        path = b"%s/%s" % (later.encode(), name.encode())
                        writer.write(b"GET %s HTTP/1.1\r\nHost: x\r\n%s\r\n" % (path, close))
                        want = _expected(status, reasons[status], ctype, body, extra, keep_alive)
                        got = await asyncio.wait_for(reader.readexactly(len(want)), 30)
                        assert got == want, (name, later, keep_alive)
                        if not keep_alive:  # and closed: the next request on a fresh connection
                            assert await asyncio.wait_for(reader.read(), 30) == b""
                            writer.close()
                            ours, theirs = socket.socketpair()
                            transport, conn = await loop.connect_accepted_socket(lambda: _Connection(server),
                                                                                 sock=ours)
                            reader, writer = await asyncio.open_connection(sock=theirs)
        # pipelined: three in one write, the middle one suspended, answered in order
        paths = (b"later/bin", b"ok", b"later/missing")
        writer.write(b"".join(b"GET /%s HTTP/1.1\r\nHost: x\r\n\r\n" % p for p in paths))
        for name in ("bin", "ok", "missing"):
            status, ctype, body, extra = table[name]
            want = _expected(status, reasons[status], ctype, body, extra, True)
            assert await asyncio.wait_for(reader.readexactly(len(want)), 30) == want, name
        assert server.in_flight == 0 and not conn.replies
        writer.close()
        transport.close()

    asyncio.run(main())


def test_a_drain_ends_when_the_last_answer_is_written_and_that_answer_closes():
    """The done callback's own write (a lone keep-alive answer) must still wake a drain, and an answer
    finished during a drain says Connection: close."""
    async def main():
        app = _HeldApp()
        server = HttpServer(app)
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        transport, conn = await loop.connect_accepted_socket(lambda: _Connection(server), sock=ours)
        reader, writer = await asyncio.open_connection(sock=theirs)
        writer.write(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
        while not app.started:
            await asyncio.sleep(0)
        drain = asyncio.ensure_future(server.drain(3600))
        await asyncio.sleep(0)
        assert not drain.done()
        app.release.set()
        await asyncio.wait_for(drain, 60)  # woken by the answer (60 s: a safety net, the drain allows 3600)
        answer = await asyncio.wait_for(reader.read(), 30)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: close\r\n" in answer, answer
        assert answer.endswith(b"\r\n\r\n/held")
        writer.close()
        transport.close()

    asyncio.run(main())


def test_with_one_request_in_flight_allowed_reading_resumes_after_each_answer():
    """max_pipelined=1 pauses reading at every request: the answer's write must resume it (the done
    callback's own write included), or the connection's second request is never read."""
    async def main():
        server = HttpServer(_TableApp({"ok": (200, b"text/plain", b"fine", ())}),
                            limits=ConnectionLimits(max_pipelined=1))
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        transport, conn = await loop.connect_accepted_socket(lambda: _Connection(server), sock=ours)
        reader, writer = await asyncio.open_connection(sock=theirs)
        want = _expected(200, b"OK", b"text/plain", b"fine", (), True)
        for path in (b"/later/ok", b"/ok", b"/later/ok"):
            writer.write(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path)
            assert await asyncio.wait_for(reader.readexactly(len(want)), 30) == want, path
        assert not conn.read_paused
        writer.close()
        transport.close()

    asyncio.run(main())


async def _connected(server):
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    transport, conn = await loop.connect_accepted_socket(lambda: _Connection(server), sock=ours)
    reader, writer = await asyncio.open_connection(sock=theirs)
    return transport, conn, reader, writer


def test_a_header_value_fed_in_small_reads_is_refused_once_past_the_head_limit():
    """httptools holds an unfinished header value and grows it by concatenation: without a bound on the
    reads inside a head, one endless value costs memory and quadratic CPU and is never answered."""
    async def main():
        limit = 16 * 1024
        server = HttpServer(_TableApp({}), limits=ConnectionLimits(max_header_bytes=limit))
        transport, conn, reader, writer = await _connected(server)
        conn.data_received(b"POST /x HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        fed = 0
        while not conn.closing and fed < 64 * limit:  # the reads the server would see, one by one
            conn.data_received(b"a" * 1024)
            fed += 1024
        assert conn.closing and fed <= limit + 2048, fed  # refused just past the limit
        answer = await asyncio.wait_for(reader.read(), 30)
        assert answer.startswith(b"HTTP/1.1 431 ") and b"Connection: close\r\n" in answer, answer[:200]
        writer.close()
        transport.close()

    asyncio.run(main())


def test_heads_near_the_limit_in_many_reads_after_a_body_are_served():
    """No false alarm: only reads wholly inside a head count, so a read holding a large body and the
    start of the next head, then that head in small reads, is served while the head is under the limit."""
    async def main():
        limit = 16 * 1024
        table = {"a": (200, b"text/plain", b"first", ()), "b": (200, b"text/plain", b"second", ())}
        server = HttpServer(_TableApp(table), limits=ConnectionLimits(max_header_bytes=limit))
        transport, conn, reader, writer = await _connected(server)
        body = b"z" * (2 * limit)
        second = b"GET /b HTTP/1.1\r\nHost: x\r\nX-Long: " + b"v" * (limit - 1024) + b"\r\n\r\n"
        conn.data_received(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                           + body + second[:10])
        for i in range(10, len(second), 512):
            conn.data_received(second[i:i + 512])
        for text in (b"first", b"second"):
            want = _expected(200, b"OK", b"text/plain", text, (), True)
            assert await asyncio.wait_for(reader.readexactly(len(want)), 30) == want
        assert not conn.closing
        writer.close()
        transport.close()

    asyncio.run(main())
