"""A front-end process's data plane in a multi-worker server: the DataPlane protocol answered by the
model host (serve/host.py) over a Unix socket. Inputs are written into this process's shared-memory
arena and read in place by the host; outputs come back in the arena the host writes into and are
copied out here, their blocks released with the next request (no extra message per answer).

Synchronous calls (health, metadata, config, statistics, index, metrics, shared-memory registry) block
this front-end's loop for one round trip to the host (tens of µs): they are not on the inference path,
and asking the host every time is what keeps every front-end consistent with a load or unload that
came in through another one.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from azulite.errors import Internal, Unavailable
from azulite.serve import coalesce, ipc, shm_ring
from azulite.serve.frontend_views import RemoteMetrics, RemoteShm, RemoteTrace
from azulite.serve.types import InferRequest, InferResponse


class _Then:
    """An infer_then request in flight: its future (cancelled: the client went away), the answer's callback,
    and the future's done callback that tells ``then`` of a cancel."""

    __slots__ = ("future", "then", "on_cancel", "request", "rid", "group")

    def __init__(self, future: asyncio.Future, then: Callable, request: InferRequest, plane: RemoteDataPlane) -> None:
        self.future, self.then, self.request = future, then, request
        self.rid = 0  # the host's request id, once sent (a coalesced one's: its group's)
        self.group: _Coalesced | None = None
        self.on_cancel = partial(plane._cancelled, self)
        future.add_done_callback(self.on_cancel)


def _rows(entry: _Then) -> int:
    return entry.request.inputs[0].data.shape[0]


class _Coalesced:
    """Requests sent to the host as one (serve/coalesce.py): theirs, in row order, and (id, rows) of each."""

    __slots__ = ("entries", "parts", "key")

    def __init__(self, entries: list[_Then], parts: list[tuple[str, int]], key: tuple[str, str]) -> None:
        self.entries, self.parts, self.key = entries, parts, key


#: seconds a model the host would not coalesce for is sent one by one before this front-end asks again
COALESCE_RETRY_S = 5.0


class RemoteDataPlane:
    """Construct, ``await connect()``, then use as a :class:`azulite.serve.types.DataPlane`."""

    def __init__(self, path: str, arena_bytes: int = shm_ring.DEFAULT_ARENA_BYTES) -> None:
        self.path = path
        self.arena_bytes = arena_bytes
        self.metrics = RemoteMetrics(self)
        self.shm = RemoteShm(self)
        self._sync: socket.socket | None = None
        self._sync_lock = threading.Lock()  # BLS-free, but a front-end's threads could still call
        self._arena: shm_ring.Arena | None = None
        self._out: tuple | None = None
        self._proto: ipc.FrameProtocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the connection to the host
        self._pending: dict[int, Any] = {}
        self._blocks: dict[int, list[int]] = {}
        self._released: list[int] = []
        self._rid = 0
        self._inflight = 0
        self._closing = False
        self._closed = False
        self._lost: str = ""
        # serve/coalesce.py: requests infer_then got in this loop pass, by what they must share to go as one
        self._gather: dict[tuple, list[_Then]] = {}
        # (model, version) -> (rows the host coalesces for it, 0: none; when to ask again if 0)
        self._limits: dict[tuple[str, str], tuple[int, float]] = {}

    async def connect(self) -> None:
        sync = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sync.connect(self.path)
        socket.send_fds(sync, [b"sync"], [])
        if sync.recv(2) != b"ok":
            raise ConnectionError("the model host refused the connection")
        self._sync = sync
        self._arena = shm_ring.Arena(self.arena_bytes)
        out_fd = os.memfd_create("azulite-answers", os.MFD_CLOEXEC)
        os.ftruncate(out_fd, self.arena_bytes)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.path)
        socket.send_fds(sock, [b"async"], [self._arena.fd, out_fd])
        if sock.recv(2) != b"ok":
            raise ConnectionError("the model host refused the connection")
        self._out = shm_ring.attach(out_fd)
        sock.setblocking(False)
        proto = ipc.FrameProtocol(self._on_frame, self._on_lost)
        self._loop = asyncio.get_running_loop()  # kept for each request's future (no getpid() call per request)
        await self._loop.create_unix_connection(lambda: proto, sock=sock)
        self._proto = proto

    # --- answers from the host ---------------------------------------------------------------------

    def _on_frame(self, header: tuple, inline: memoryview) -> None:
        kind, rid = header[0], header[1]
        target = self._pending.get(rid)
        if type(target) is _Coalesced:
            self._coalesced_answer(target, header, inline)
            return
        if kind in ("r", "s"):
            try:
                value = self._answer_of(header[2], inline)
            except Internal as exc:  # answered as this request's error, never a hang
                value = exc
                if kind == "s":  # the stream's inputs stay in use until the host ends it
                    if target is not None:
                        target.put_nowait(("error", value))
                    return
                kind = "e"
        elif kind == "e":
            value = ipc.rebuild_error(header[2])
        else:
            value = None
        if kind == "s":
            if target is not None:
                target.put_nowait(("item", value))
            return
        self._pending.pop(rid, None)
        for offset in self._blocks.pop(rid, ()):
            self._arena.free(offset)  # type: ignore[union-attr]
        if type(target) is _Then:
            self._settle(target, value, kind == "e")
        elif isinstance(target, asyncio.Queue):
            target.put_nowait(("error", value) if kind == "e" else ("end", None))
        elif target is not None and not target.done():
            if kind == "e":
                target.set_exception(value)
            else:
                target.set_result(value)

    def _coalesced_answer(self, target: _Coalesced, header: tuple, inline: memoryview) -> None:
        kind, rid = header[0], header[1]
        del self._pending[rid]
        for offset in self._blocks.pop(rid, ()):
            self._arena.free(offset)  # type: ignore[union-attr]
        entries = target.entries
        if kind == "e":
            error = ipc.rebuild_error(header[2])
            for entry in entries:
                self._settle(entry, error, True)
            return
        limit = header[3]
        self._limits[target.key] = (limit, 0.0 if limit else time.monotonic() + COALESCE_RETRY_S)
        if kind == "R":
            try:
                answers = coalesce.split_response(self._answer_of(header[2], inline), target.parts)
            except Internal as error:  # every part's error, never a hang
                for entry in entries:
                    self._settle(entry, error, True)
                return
            for entry, answer in zip(entries, answers):
                self._settle(entry, answer, False)
            return
        for entry, (part_kind, body) in zip(entries, header[2]):
            if part_kind == "e":
                self._settle(entry, ipc.rebuild_error(body), True)
                continue
            try:
                self._settle(entry, self._answer_of(body, inline), False)
            except Internal as error:
                self._settle(entry, error, True)

    def _answer_of(self, body: tuple, inline: memoryview) -> InferResponse:
        """An answer read back from its header and the host's arena (its blocks released with this
        front-end's next frame); a traced one reports its send to the host's tracer. Internal when it
        cannot be read."""
        self._released.extend(ref[1] for ref in body[5] if ref[0] == "s")
        try:
            value, trace_id = ipc.response_from(body, self._out[1], inline)  # type: ignore[index]
        except Exception as exc:  # noqa: BLE001
            raise Internal(f"reading the model host's answer: {type(exc).__name__}: {exc}") from None
        if trace_id:
            value.trace = RemoteTrace(self, trace_id)
        return value

    def _settle(self, entry: _Then, value: Any, failed: bool) -> None:
        """An infer_then request's answer (nothing when its client went away: ``then`` heard the cancel)."""
        future = entry.future
        if future.done():
            return
        self._inflight -= 1
        future.remove_done_callback(entry.on_cancel)
        future.set_result(None)
        if failed:
            entry.then(None, value)
        else:
            entry.then(value, None)

    def _cancelled(self, entry: _Then, future: asyncio.Future) -> None:
        """An infer_then request's future cancelled (its client went away) before its answer came: the host
        is told (a request still queued there then never runs; a coalesced one only once all its callers
        are gone)."""
        self._inflight -= 1
        entry.then(None, asyncio.CancelledError())
        if entry.rid and (entry.group is None or all(e.future.done() for e in entry.group.entries)):
            try:
                self._send("cancel", 0, entry.rid)
            except Unavailable:  # the host is gone, and the request with it
                pass

    def _on_lost(self) -> None:
        self._lost = "the model host is gone (it is being restarted)"
        error = Unavailable(self._lost)
        pending = list(self._pending.values())
        for group in self._gather.values():
            pending.extend(group)
        self._gather.clear()
        for target in pending:
            if type(target) is _Then:
                self._settle(target, error, True)
            elif type(target) is _Coalesced:
                for entry in target.entries:
                    self._settle(entry, error, True)
            elif isinstance(target, asyncio.Queue):
                target.put_nowait(("error", error))
            elif not target.done():
                target.set_exception(error)
        self._pending.clear()

    def _frame(self, op: str, rid: int, *args: Any, payload=None) -> list:
        """A frame to the host, carrying the answer blocks this front-end has read since its last one."""
        released, self._released = self._released, []
        return ipc.frame((op, rid, released, *args), payload)

    def _send(self, op: str, rid: int, *args: Any, payload=None) -> None:
        if self._lost:
            raise Unavailable(self._lost)
        self._proto.writelines(self._frame(op, rid, *args, payload=payload))  # type: ignore[union-attr]

    def _next(self) -> int:
        self._rid += 1
        return self._rid

    def call(self, method: str, *args: Any) -> Any:
        """One synchronous call to the host (blocks this thread for the round trip)."""
        if self._sync is None:
            raise Unavailable("the front-end is not connected to the model host")
        with self._sync_lock:
            try:
                ipc.send_frame(self._sync, (method, args))
                header, _ = ipc.recv_frame(self._sync)
            except OSError:
                raise Unavailable("the model host is gone (it is being restarted)") from None
        if header[0] == "e":
            raise ipc.rebuild_error(header[1])
        return ipc.from_wire(header[1])

    # --- the DataPlane protocol --------------------------------------------------------------------

    def live(self) -> bool:
        return not self._closed

    def ready(self) -> bool:
        if self._closing or self._lost:
            return False
        try:
            return bool(self.call("ready"))
        except Unavailable:
            return False

    def server_metadata(self):
        return self.call("server_metadata")

    def model_ready(self, name: str, version: str = "") -> bool:
        return bool(self.call("model_ready", name, version))

    def model_metadata(self, name: str, version: str = ""):
        return self.call("model_metadata", name, version)

    def model_config(self, name: str, version: str = ""):
        return self.call("model_config", name, version)

    def model_statistics(self, name: str = "", version: str = ""):
        return self.call("model_statistics", name, version)

    def trace_setting(self, model: str = "", changes: dict | None = None):
        return self.call("trace_setting", model, changes)  # the one tracer is the host's

    def repository_index(self, ready_only: bool = False):
        return self.call("repository_index", ready_only)

    def startup_table(self) -> list[tuple[str, str, str]]:
        return self.call("startup_table")

    async def infer(self, request: InferRequest) -> InferResponse:
        """infer_then awaited (the coroutine callers: grpc.aio, a Task path); cancelling it drops the request."""
        answered = self._loop.create_future()  # type: ignore[union-attr]

        def then(response: InferResponse | None, error: BaseException | None) -> None:
            if answered.done():  # cancelled: the caller is gone
                return
            if error is not None:
                answered.set_exception(error)
            else:
                answered.set_result(response)

        sent = self.infer_then(request, then)
        try:
            return await answered
        except asyncio.CancelledError:
            sent.cancel()
            raise

    def infer_then(self, request: InferRequest, then: Callable[[InferResponse | None, BaseException | None], None]
                   ) -> asyncio.Future:
        """infer without a coroutine or a Task (as TritonDataPlane.infer_then): ``then(response, None)`` or
        ``then(None, error)`` is called once, later; cancel the returned future to drop the request (``then``
        gets the CancelledError). Requests for one model got in the same loop pass go to the host as one
        where they can (serve/coalesce.py): sent at the end of the pass."""
        if self._closing:
            raise Unavailable("the server is shutting down and accepts no new requests")
        if self._lost:
            raise Unavailable(self._lost)
        entry = _Then(self._loop.create_future(), then, request, self)  # type: ignore[union-attr]
        key = coalesce.merge_key(request)
        if key is None:
            key = (id(entry),)  # a group of its own
        group = self._gather.get(key)
        if group is None:
            if not self._gather:
                self._loop.call_soon(self._flush_gathered)  # type: ignore[union-attr]
            self._gather[key] = [entry]
        else:
            group.append(entry)
        self._inflight += 1
        return entry.future

    def _flush_gathered(self) -> None:
        gathered, self._gather = self._gather, {}
        if self._lost:
            error = Unavailable(self._lost)
            for group in gathered.values():
                for entry in group:
                    self._settle(entry, error, True)
            return
        frames: list = []
        now = 0.0
        for group in gathered.values():
            entries = [e for e in group if not e.future.done()]  # a client gone before it was sent
            first = entries[0].request if entries else None
            known = self._limits.get((first.model_name, first.model_version)) if len(entries) > 1 else None
            if known is not None and not known[0] and (now := now or time.monotonic()) < known[1]:
                chunks = [[entry] for entry in entries]  # the host said no lately: one by one
            else:
                chunks = coalesce.chunks(entries, known[0] if known is not None else 0, _rows) if entries else ()
            for chunk in chunks:
                if len(chunk) == 1:
                    self._send_one(chunk[0], frames)
                else:
                    self._send_coalesced(chunk, frames)
        if frames:
            self._proto.write_now(frames)  # type: ignore[union-attr]

    def _send_one(self, entry: _Then, frames: list) -> None:
        request = entry.request
        rid = self._next()
        try:
            metas, packed = ipc.pack_tensors(self._arena, request.inputs)
        except Exception as exc:  # noqa: BLE001 - the request's answer
            self._settle(entry, Internal(f"sending to the model host: {type(exc).__name__}: {exc}"), True)
            return
        self._pending[rid] = entry
        self._blocks[rid] = packed.blocks
        entry.rid = rid
        frames.extend(self._frame("infer", rid, ipc.request_header(request, metas, packed.refs), payload=packed.inline))

    def _send_coalesced(self, entries: list[_Then], frames: list) -> None:
        requests = [e.request for e in entries]
        rid = self._next()
        packed = shm_ring.Packed()
        try:
            merged, metas = coalesce.pack_merged(self._arena, requests, packed)
        except Exception as exc:  # noqa: BLE001
            for offset in packed.blocks:
                self._arena.free(offset)  # type: ignore[union-attr]
            error = Internal(f"sending to the model host: {type(exc).__name__}: {exc}")
            for entry in entries:
                self._settle(entry, error, True)
            return
        parts = coalesce.parts_of(requests)
        group = self._pending[rid] = _Coalesced(entries, parts, (merged.model_name, merged.model_version))
        for entry in entries:
            entry.rid, entry.group = rid, group
        self._blocks[rid] = packed.blocks
        frames.extend(self._frame("coalesced", rid, ipc.request_header(merged, metas, packed.refs), parts,
                                  payload=packed.inline))

    async def infer_stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        if self._closing:
            raise Unavailable("the server is shutting down and accepts no new requests")
        rid = self._next()
        metas, packed = ipc.pack_tensors(self._arena, request.inputs)
        queue: asyncio.Queue = asyncio.Queue()
        self._pending[rid] = queue
        self._blocks[rid] = packed.blocks
        self._send("stream", rid, ipc.request_header(request, metas, packed.refs), payload=packed.inline)
        self._inflight += 1
        try:
            while True:
                kind, value = await queue.get()
                if kind == "item":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            self._inflight -= 1

    async def _control(self, op: str, *args: Any) -> None:
        rid = self._next()
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self._send(op, rid, *args)
        await fut

    async def load_model(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        await self._control("load", name, parameters)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        await self._control("unload", name, unload_dependents)

    def start_polling(self, interval_s: float = 15.0) -> None:
        """The model host polls the repository; a front-end has nothing to do."""

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        self._closing = True
        deadline = time.monotonic() + drain_timeout_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        if self._sync is not None:
            self._sync.close()
        self._closed = True

    @property
    def in_flight(self) -> int:
        return self._inflight

