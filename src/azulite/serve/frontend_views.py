"""What a front-end process (serve/frontend_plane.py) answers from the model host rather than itself: the
shared-memory registry, the metrics text and a traced answer's trace, each a thin view over the host's one
copy (every front-end then answers the same)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from azulite.errors import Unavailable
from azulite.serve.metrics import ServerMetrics

if TYPE_CHECKING:
    from azulite.serve.frontend_plane import RemoteDataPlane


class RemoteShm:
    """The model host's registry (serve/shm.py), where the regions are mapped and the requests resolved."""

    def __init__(self, plane: RemoteDataPlane) -> None:
        self._plane = plane

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._plane.call("shm_register", name, key, offset, byte_size)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self._plane.call("shm_register_cuda", name, raw_handle, device_id, byte_size)

    def unregister(self, name: str = "", kind: str = "system") -> None:
        self._plane.call("shm_unregister", name, kind)

    def status(self, name: str = "", kind: str = "system") -> list[dict]:
        return self._plane.call("shm_status", name, kind)


class RemoteMetrics:
    content_type = ServerMetrics.content_type

    def __init__(self, plane: RemoteDataPlane) -> None:
        self._plane = plane
        # the host renders the whole server's metrics: this front-end's own collectors are not merged,
        # its guard counters reach the host through serve/guard_counts.py
        self.extra: list = []
        self.refresh: list = []  # called before each scrape (this front-end's counts published first)

    def metrics_text(self) -> bytes:
        for refresh in self.refresh:
            refresh()
        return self._plane.call("metrics_text")


class RemoteTrace:
    """A traced answer's trace, held by the model host's tracer until this front-end reports the send."""

    __slots__ = ("_plane", "id")

    def __init__(self, plane: RemoteDataPlane, trace_id: int) -> None:
        self._plane, self.id = plane, trace_id

    def sent(self, start_ns: int, end_ns: int) -> None:
        try:
            self._plane._send("sent", 0, self.id, start_ns, end_ns)
        except Unavailable:  # the host is gone, and its traces with it
            pass
