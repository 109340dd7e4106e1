"""The model host of a multi-worker server (``azulite serve --workers N``): the one process that holds
the data plane (models, their batchers and statistics, sequences, shared-memory regions) and answers
the front-end processes over a Unix socket.

Why one host behind N front-ends: requests for a model from every front-end then meet in ONE dynamic
batcher (batches do not shrink as front-ends are added), and model control, statistics and metrics have
one source, so every front-end answers the same. The front-ends do the per-request protocol work
(HTTP/gRPC parsing, encoding, auth), which is where a single event loop ran out of core; model
instances run in their own processes where they need their own interpreter (serve/instances.py).

Each front-end opens two connections: an asynchronous one (inference, streams, load/unload; its hello
carries two memfds: the front-end's input arena and the output arena this host writes answers into) and
a synchronous one (health, metadata, configs, statistics, index, metrics, shared-memory registry: short
calls a front-end answers from inside a synchronous handler).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from typing import Any

from azulite.errors import Unavailable
from azulite.serve import ipc, shm_ring
from azulite.serve.coalesce_host import CoalescedCounts, infer_coalesced
from azulite.serve.dataplane import TritonDataPlane

log = logging.getLogger("azulite.serve.host")

#: what a front-end may ask on the synchronous connection
SYNC_CALLS = frozenset({"ready", "server_metadata", "model_ready", "model_metadata", "model_config",
                        "model_statistics", "repository_index", "startup_table", "metrics_text",
                        "shm_register", "shm_register_cuda", "shm_unregister", "shm_status", "trace_setting"})


#: the answer to a request its front-end cancelled (nobody reads it: it frees the request's blocks there)
_GONE = Unavailable("the caller went away before the answer")


class ModelHost:
    def __init__(self, dataplane: TritonDataPlane, path: str) -> None:
        self.dp = dataplane
        self.path = path
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.coalesced = CoalescedCounts()  # serve/coalesce.py
        dataplane.metrics.extra.append(self.coalesced.metrics)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        sock.listen(256)
        sock.setblocking(False)
        self._listener = sock
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            task = loop.create_task(self._client(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def stop_accepting(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        if self._listener is not None:
            self._listener.close()

    async def close(self) -> None:
        await self.stop_accepting()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _client(self, conn: socket.socket) -> None:
        # The hello is one message sent before anything else, so reading it apart from the stream is safe.
        conn.setblocking(True)
        try:
            msg, fds, _, _ = await asyncio.to_thread(socket.recv_fds, conn, 256, 2)
        except OSError:
            conn.close()
            return
        if msg == b"sync" and not fds:
            # its own thread, not the loop's default executor (which model loads use)
            threading.Thread(target=self._serve_sync, args=(conn,), daemon=True, name="azulite-host-sync").start()
            return
        if msg != b"async" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        in_map, in_view = shm_ring.attach(fds[0])
        out = shm_ring.Arena(fd=fds[1])
        conn.sendall(b"ok")
        conn.setblocking(False)
        loop = asyncio.get_running_loop()
        lost = loop.create_future()
        tasks: dict[int, asyncio.Task] = {}  # by the front-end's request id: a "cancel" names one

        def on_frame(header: tuple, inline: memoryview) -> None:
            op, rid, released = header[0], header[1], header[2]
            for offset in released:
                out.free(offset)
            if op == "infer":
                coro = self._infer(proto, out, rid, header[3], in_view, inline)
            elif op == "coalesced":  # several clients' requests as one (serve/coalesce.py)
                coro = self._coalesced(proto, out, rid, header[3], header[4], in_view, inline)
            elif op == "stream":
                coro = self._stream(proto, out, rid, header[3], in_view, inline)
            elif op == "load":
                coro = self._control(proto, rid, self.dp.load_model(header[3], header[4]))
            elif op == "unload":
                coro = self._control(proto, rid, self.dp.unload_model(header[3], header[4]))
            elif op == "sent":  # a traced answer's send, reported by the front-end (serve/trace.py)
                self.dp.tracer.release(header[3], header[4], header[5])
                return
            elif op == "cancel":  # its caller went away (a reset, a gRPC deadline): a queued request never runs
                task = tasks.get(header[3])
                if task is not None:
                    task.cancel()
                return
            else:
                proto.writelines(ipc.frame(("e", rid, ipc.error_tuple(ValueError(f"unknown operation {op!r}")))))
                return
            task = loop.create_task(coro)
            tasks[rid] = task
            task.add_done_callback(lambda _, rid=rid: tasks.pop(rid, None))

        def on_lost() -> None:
            if not lost.done():
                lost.set_result(None)

        # made before the connection: frames may arrive before create_unix_connection returns
        proto = ipc.FrameProtocol(on_frame, on_lost)
        transport, _ = await loop.create_unix_connection(lambda: proto, sock=conn)
        try:
            await lost
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            transport.close()
            try:
                in_view.release()
                in_map.close()
            except BufferError:  # a request's arrays still view it: the mapping goes with them
                pass
            out.close()

    @staticmethod
    def _answer(writer, out, kind: str, rid: int, response) -> None:
        metas, packed = ipc.pack_tensors(out, response.outputs)
        writer.writelines(ipc.frame((kind, rid, ipc.response_header(response, metas, packed.refs)), packed.inline))

    async def _infer(self, writer, out, rid, header, in_view, inline) -> None:
        try:
            request = ipc.request_from(header, in_view, inline, copy=False)  # inputs read in place
            self._answer(writer, out, "r", rid, await self.dp.infer(request))
        except Exception as exc:  # noqa: BLE001 - every failure is the request's answer, never a hang
            writer.writelines(ipc.frame(("e", rid, ipc.error_tuple(exc))))
        except asyncio.CancelledError:  # answered still: the front-end frees the request's blocks with it
            writer.writelines(ipc.frame(("e", rid, ipc.error_tuple(_GONE))))
            raise

    async def _coalesced(self, writer, out, rid, header, parts, in_view, inline) -> None:
        """("R", rid, the coalesced answer's header, limit) or ("P", rid, [("r", header) | ("e", error) per
        part], limit): one frame either way, the parts' outputs in one payload."""
        try:
            request = ipc.request_from(header, in_view, inline, copy=False)
            kind, value, limit = await infer_coalesced(self.dp, request, parts)
            self.coalesced.count(request.model_name, "one_by_one" if kind == "one_by_one" else "together", len(parts))
            if kind == "one":
                metas, packed = ipc.pack_tensors(out, value.outputs)
                writer.writelines(ipc.frame(("R", rid, ipc.response_header(value, metas, packed.refs), limit),
                                            packed.inline))
                return
            packed = shm_ring.Packed()
            answers = []
            for answer in value:
                if isinstance(answer, BaseException):
                    answers.append(("e", ipc.error_tuple(answer)))
                    continue
                first = len(packed.refs)
                metas, _ = ipc.pack_tensors(out, answer.outputs, packed)
                answers.append(("r", ipc.response_header(answer, metas, packed.refs[first:])))
            writer.writelines(ipc.frame(("P", rid, answers, limit), packed.inline))
        except Exception as exc:  # noqa: BLE001 - every part's answer, never a hang
            writer.writelines(ipc.frame(("e", rid, ipc.error_tuple(exc))))
        except asyncio.CancelledError:
            writer.writelines(ipc.frame(("e", rid, ipc.error_tuple(_GONE))))
            raise

    async def _stream(self, writer, out, rid, header, in_view, inline) -> None:
        try:
            request = ipc.request_from(header, in_view, inline, copy=False)
            async for response in self.dp.infer_stream(request):
                self._answer(writer, out, "s", rid, response)
        except Exception as exc:  # noqa: BLE001
            writer.writelines(ipc.frame(("e", rid, ipc.error_tuple(exc))))
            return
        writer.writelines(ipc.frame(("z", rid)))

    @staticmethod
    async def _control(writer, rid, coro) -> None:
        try:
            await coro
        except Exception as exc:  # noqa: BLE001
            writer.writelines(ipc.frame(("e", rid, ipc.error_tuple(exc))))
            return
        writer.writelines(ipc.frame(("o", rid)))

    # --- the synchronous connection: one thread per front-end, each call run on the loop ----------------

    def _serve_sync(self, conn: socket.socket) -> None:
        loop = self._loop
        assert loop is not None
        conn.sendall(b"ok")
        with conn:
            while True:
                try:
                    header, _ = ipc.recv_frame(conn)
                except (ConnectionError, OSError):
                    return
                method, args = header
                try:
                    if method not in SYNC_CALLS:
                        raise ValueError(f"unknown call {method!r}")
                    fut = asyncio.run_coroutine_threadsafe(self._sync_call(method, args), loop)
                    reply = ("o", ipc.to_wire(fut.result()))
                except Exception as exc:  # noqa: BLE001
                    reply = ("e", ipc.error_tuple(exc))
                try:
                    ipc.send_frame(conn, reply)
                except OSError:
                    return

    async def _sync_call(self, method: str, args: tuple) -> Any:
        dp = self.dp
        if method == "shm_register":
            return dp.shm.register(*args)
        if method == "shm_register_cuda":
            return dp.shm.register_cuda(*args)
        if method == "shm_unregister":
            return dp.shm.unregister(*args)
        if method == "shm_status":
            return dp.shm.status(*args)
        if method == "metrics_text":
            return dp.metrics.metrics_text()
        return getattr(dp, method)(*args)
