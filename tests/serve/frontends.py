"""A real azulite server (data plane + HTTP + gRPC + metrics) on free loopback ports, in a background
thread with its own event loop, for the front-end tests. Always stopped by the fixture that started it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from azulite.serve.server import Server, ServerSettings, new_event_loop


class ServerThread:
    def __init__(self, repository: Path, **kw) -> None:
        self.settings = ServerSettings(repository=repository, http_address="127.0.0.1", http_port=0,
                                       grpc_address="127.0.0.1", grpc_port=0, metrics_address="127.0.0.1",
                                       metrics_port=0, **kw)
        self.server = Server(self.settings)
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name="azulite-test-server", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.start())
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()

    def start(self) -> "ServerThread":
        self._thread.start()
        if not self._started.wait(180):
            raise TimeoutError("the test server did not start in 180 s")
        if self._error is not None:
            raise self._error
        return self

    def call(self, coro, timeout: float = 120):
        """Run a coroutine on the server's loop from the test thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        if self._thread.is_alive() and self.loop.is_running():
            try:
                self.call(self.server.stop(drain_timeout_s), timeout=drain_timeout_s + 60)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(60)
        if not self.loop.is_closed() and not self.loop.is_running():
            self.loop.close()

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.server.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.server.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.server.ports['metrics']}/metrics"


@contextmanager
def running_server(repository: Path, **kw) -> Iterator[ServerThread]:
    server = ServerThread(repository, **kw)
    try:
        yield server.start()
    finally:
        server.stop()
