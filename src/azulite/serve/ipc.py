"""Frames between azulite's own processes over Unix sockets: ``<header length><payload length>``, a
header (a small tuple: operation, request id, descriptors; pickled, as both ends are this server's own
processes behind a 0700 directory), then the inline payload (raw tensor bytes, see shm_ring).

Errors cross as (class name, message, where, fix) and come back as the same ServeError subclass, so a
front-end answers a client exactly as the model host's data plane decided.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct

from azulite import errors
from azulite.errors import Internal, ServeError
from azulite.serve import shm_ring
from azulite.serve.types import InferRequest, InferResponse, InferTensor, RequestedOutput

_FRAME = struct.Struct("<II")
PROTOCOL = pickle.HIGHEST_PROTOCOL


def frame(header: tuple, payload: list[bytes | memoryview] | None = None) -> list[bytes | memoryview]:
    head = pickle.dumps(header, PROTOCOL)
    size = sum(len(p) for p in payload) if payload else 0
    return [_FRAME.pack(len(head), size), head, *(payload or ())]


_EMPTY = memoryview(b"")


class FrameProtocol(asyncio.Protocol):
    """Frames off a stream socket, each handed to ``on_frame(header, payload)`` as it completes (a
    protocol, not a StreamReader: no coroutine and no three reads per frame on the inference path);
    ``on_lost()`` when the peer is gone. ``writelines`` sends a frame's parts."""

    def __init__(self, on_frame, on_lost) -> None:
        self.on_frame = on_frame
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._need = 0  # bytes the buffered partial frame needs before it can be parsed
        self._out: list = []  # frames written this loop pass, sent together (one syscall, not one each)
        self._loop: asyncio.AbstractEventLoop | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        # kept: asyncio.get_running_loop() costs a getpid() system call on Python 3.11, once per frame sent
        self._loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        if self._buf:
            self._buf += data
            if len(self._buf) < self._need:  # a large frame arriving in pieces: copy it once, at the end
                return
            data = bytes(self._buf)
            self._buf.clear()
        pos, n = 0, len(data)
        while n - pos >= _FRAME.size:
            head_len, size = _FRAME.unpack_from(data, pos)
            start = pos + _FRAME.size
            end = start + head_len + size
            if end > n:
                break
            header = pickle.loads(data[start:start + head_len])
            payload = memoryview(data)[start + head_len:end] if size else _EMPTY
            pos = end
            self.on_frame(header, payload)
        if pos < n:
            self._buf += data[pos:]
            self._need = _FRAME.size + sum(_FRAME.unpack_from(data, pos)) if n - pos >= _FRAME.size else _FRAME.size

    def connection_lost(self, exc) -> None:
        self.on_lost()

    def writelines(self, parts) -> None:
        if not self._out:
            self._loop.call_soon(self._flush)  # type: ignore[union-attr] # set by connection_made
        self._out.extend(parts)

    def write_now(self, parts) -> None:
        """writelines, sent in this loop pass (with whatever writelines gathered before it)."""
        self._out.extend(parts)
        self._flush()

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(out)


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return buf


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the peer process closed the connection")
        got += k


def recv_frame(sock: socket.socket) -> tuple[tuple, memoryview]:
    head_len, size = _FRAME.unpack(_recv_exactly(sock, _FRAME.size))
    head = _recv_exactly(sock, head_len)
    payload = _recv_exactly(sock, size) if size else bytearray()
    return pickle.loads(head), memoryview(payload)


def send_frame(sock: socket.socket, header: tuple, payload: list[bytes | memoryview] | None = None) -> None:
    """One sendmsg of the frame's parts (gathered by the kernel: the payload is not copied into a joined
    bytes first); the rest with sendall when the socket took only part of it."""
    parts = frame(header, payload)
    if len(parts) > 512:  # far below the kernel's IOV_MAX (1024) on what one sendmsg may gather
        parts = [b"".join(bytes(p) for p in parts)]
    sent = sock.sendmsg(parts)
    total = sum(len(p) for p in parts)
    if sent < total:
        sock.sendall(b"".join(bytes(p) for p in parts)[sent:])


class Channel:
    """Frames over a blocking socket for a request/answer crossing (an instance process and its
    server): a frame usually arrives with ONE recv (the length prefix, header and whatever payload
    came with them land in a reused buffer) where :func:`recv_frame` makes two or three, and goes out
    with one sendmsg. The payload of a frame is its own buffer (arrays read in place from it may be
    kept by whoever got them; the reused buffer is never handed out)."""

    def __init__(self, sock: socket.socket, size: int = 1 << 16) -> None:
        self.sock = sock
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    def send(self, header: tuple, payload: list[bytes | memoryview] | None = None) -> None:
        send_frame(self.sock, header, payload)

    def _fill(self, need: int) -> None:
        """Receive until ``need`` bytes from _start are buffered."""
        if self._start + need > len(self._buf):
            self._room(need)
        while self._end - self._start < need:
            k = self.sock.recv_into(self._view[self._end:])
            if k == 0:
                raise ConnectionError("the peer process closed the connection")
            self._end += k

    def try_recv(self) -> tuple[tuple, memoryview] | None:
        """The next frame if all of it has arrived, else None; never waits, whatever mode the socket is
        in (MSG_DONTWAIT: an event loop's poller may have made it non-blocking, or not)."""
        while True:
            held = self._end - self._start
            if held >= _FRAME.size:
                head_len, size = _FRAME.unpack_from(self._buf, self._start)
                if held >= _FRAME.size + head_len + size:
                    return self.recv()  # all buffered: recv does not touch the socket
                need = _FRAME.size + head_len + size
            else:
                need = _FRAME.size
            if self._start + need > len(self._buf):
                self._room(need)
            try:
                k = self.sock.recv_into(self._view[self._end:], 0, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return None
            if k == 0:
                raise ConnectionError("the peer process closed the connection")
            self._end += k

    def _room(self, need: int) -> None:
        """Room for ``need`` bytes from _start: what is buffered moved to the front (or a larger buffer)."""
        held = self._end - self._start
        if need > len(self._buf):
            self._view.release()
            buf = bytearray(max(need, 2 * len(self._buf)))
            buf[:held] = self._buf[self._start:self._end]
            self._buf, self._view = buf, memoryview(buf)
        else:
            self._buf[:held] = self._buf[self._start:self._end]
        self._start, self._end = 0, held

    def recv(self) -> tuple[tuple, memoryview]:
        if self._end - self._start < _FRAME.size:
            self._fill(_FRAME.size)
        head_len, size = _FRAME.unpack_from(self._buf, self._start)
        need = _FRAME.size + head_len
        if self._end - self._start < need:
            self._fill(need)
        start = self._start + _FRAME.size
        header = pickle.loads(self._view[start:start + head_len])
        self._start += need
        payload = _EMPTY
        if size:
            out = bytearray(size)
            have = min(size, self._end - self._start)
            out[:have] = self._view[self._start:self._start + have]
            self._start += have
            payload = memoryview(out)
            if have < size:
                _recv_into(self.sock, payload[have:])
        if self._start == self._end:
            self._start = self._end = 0
        return header, payload


def error_tuple(exc: BaseException) -> tuple:
    if isinstance(exc, ServeError):
        extra = getattr(exc, "retry_after_s", None)
        return (type(exc).__name__, exc.message, exc.where, exc.fix, exc.status, extra)
    return ("Internal", f"{type(exc).__name__}: {exc}", None, None, "INTERNAL", None)


def rebuild_error(t: tuple) -> ServeError:
    name, message, where, fix, status, extra = t
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ServeError)):
        # a subclass defined outside azulite.errors (e.g. the batcher's Rejected): keep its status
        cls = {"UNAVAILABLE": errors.Unavailable, "INVALID_ARGUMENT": errors.InvalidArgument,
               "NOT_FOUND": errors.NotFound, "UNIMPLEMENTED": errors.Unsupported}.get(status, Internal)
    if extra is not None and name == "ResourceExhausted":
        return cls(message, retry_after_s=extra, where=where, fix=fix)
    error = cls(message, where=where, fix=fix)
    if error.status != status:  # e.g. shm's RegionExists (ALREADY_EXISTS): the client sees the same class
        error.status = status
    return error


# --- inference requests and responses as descriptors + arena blocks ------------------------------------

def pack_tensors(arena, tensors: list, packed=None):
    """(descriptors of each tensor: (name, datatype, shape, parameters, ref index or -1), Packed)."""
    packed = packed or shm_ring.Packed()
    metas, arrays = [], []
    for t in tensors:
        if t.data is None:  # a tensor living in a client's shared-memory region (serve/shm.py)
            metas.append((t.name, t.datatype, tuple(t.shape), t.parameters, -1))
        else:
            metas.append((t.name, t.datatype, tuple(t.shape), t.parameters, len(arrays)))
            arrays.append(t.data)
    shm_ring.put(arena, arrays, packed)
    return metas, packed


def unpack_tensors(view, inline, metas: list, refs: list, *, copy: bool) -> list:
    out = []
    for name, datatype, shape, parameters, i in metas:
        data = None if i < 0 else shm_ring.take(view, inline, refs[i], copy=copy)
        out.append(InferTensor(name, datatype, shape, data, parameters))  # type: ignore[arg-type]
    return out


def request_header(request, metas: list, refs: list) -> tuple:
    outputs = None if request.outputs is None else [(o.name, o.parameters) for o in request.outputs]
    return (request.model_name, request.model_version, request.id, request.parameters, outputs, metas, refs,
            request.front_end, request.recv_start, request.recv_end, request.trace_context)


def request_from(header: tuple, view, inline, *, copy: bool):
    model, version, rid, parameters, outputs, metas, refs, front_end, recv_start, recv_end, context = header
    return InferRequest(model_name=model, model_version=version, id=rid, parameters=parameters,
                        outputs=None if outputs is None else [RequestedOutput(n, p) for n, p in outputs],
                        inputs=unpack_tensors(view, inline, metas, refs, copy=copy),
                        front_end=front_end, recv_start=recv_start, recv_end=recv_end, trace_context=context)


def response_header(response, metas: list, refs: list) -> tuple:
    """The answer's header; a traced answer's trace id last (0: none), its send reported by the front-end."""
    trace = response.trace
    return (response.model_name, response.model_version, response.id, response.parameters, metas, refs,
            0 if trace is None else trace.id)


def response_from(header: tuple, view, inline):
    """The answer and its trace id (0: not traced)."""
    model, version, rid, parameters, metas, refs, trace_id = header
    return InferResponse(model_name=model, model_version=version, id=rid, parameters=parameters,
                         outputs=unpack_tensors(view, inline, metas, refs, copy=True)), trace_id


def pack_dicts(arena, dicts: list[dict], packed) -> tuple:
    """Named arrays of a batch's requests (inputs going to an instance process, or its results coming
    back) as one descriptor. When every dict has the same names and each name is :func:`shm_ring.stackable`
    across them (a dynamic batch of one model's requests, the usual case): ("rows", [(name, ref index,
    first dimension of each)]), one block per name. Otherwise ("each", [[(name, ref index)] per dict])."""
    names = list(dicts[0]) if dicts else []
    columns = None
    if len(dicts) == 1:  # one request's (every batch at concurrency 1): each array is its own column
        columns = [[a] for a in dicts[0].values()]
    elif names and all(len(d) == len(names) for d in dicts):
        try:
            columns = [[d[n] for d in dicts] for n in names]
        except KeyError:
            pass
    if names and columns is not None and all(shm_ring.stackable(c) for c in columns):
        out = []
        for name, arrays in zip(names, columns):
            out.append((name, len(packed.refs), [a.shape[0] for a in arrays]))
            shm_ring.put_rows(arena, arrays, packed)
        return ("rows", out)
    each = []
    for d in dicts:
        keys = list(d)
        start = len(packed.refs)
        shm_ring.put(arena, [d[k] for k in keys], packed)
        each.append([(k, start + i) for i, k in enumerate(keys)])
    return ("each", each)


def unpack_dicts(view, inline, desc: tuple, refs: list, *, copy: bool) -> list[dict]:
    kind, body = desc
    if kind == "each":
        return [{name: shm_ring.take(view, inline, refs[i], copy=copy) for name, i in entry} for entry in body]
    dicts: list[dict] = []
    for name, i, rows in body:
        pieces = shm_ring.take_rows(view, inline, refs[i], rows, copy=copy)
        if not dicts:
            dicts = [{} for _ in pieces]
        for d, piece in zip(dicts, pieces):
            d[name] = piece
    return dicts


# --- protobuf answers (tritonclient's generated modules do not pickle) -----------------------------------

def to_wire(value):
    from google.protobuf.message import Message

    if isinstance(value, Message):
        return ("pb", type(value).DESCRIPTOR.name, value.SerializeToString())
    return ("py", value)


def from_wire(wire):
    if wire[0] == "py":
        return wire[1]
    from azulite.serve.proto import model_config_pb2 as mc
    from azulite.serve.proto import service_pb2 as pb

    cls = getattr(pb, wire[1], None) or getattr(mc, wire[1])
    message = cls()
    message.ParseFromString(wire[2])
    return message
