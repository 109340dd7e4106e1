"""Frames between azulite's processes: whatever way the stream cuts them, each frame comes out whole and
once (one receive per frame on a request/answer crossing); errors cross as the same class and status; a
batch's tensors cross as one block per input."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from azulite.errors import InvalidArgument, NotFound, ResourceExhausted
from azulite.serve import ipc, shm_ring
from azulite.serve.batcher import Rejected


def _stream(frames):
    return b"".join(bytes(p) for f in frames for p in ipc.frame(*f))


def test_frames_survive_any_cut():
    frames = [(("infer", 1, [], {"a": 1}), [b"xyz", memoryview(b"0123456789")]), (("o", 2),),
              (("big", 3), [b"\x01" * 100_000]), (("z", 4), [])]
    data = _stream(frames)
    for cut in (1, 7, 8, 9, 4096, len(data)):
        got = []
        proto = ipc.FrameProtocol(lambda h, p: got.append((h, bytes(p))), lambda: None)
        for i in range(0, len(data), cut):
            proto.data_received(data[i:i + cut])
        assert got == [(("infer", 1, [], {"a": 1}), b"xyz0123456789"), (("o", 2), b""),
                       (("big", 3), b"\x01" * 100_000), (("z", 4), b"")], cut


def test_errors_keep_their_class_and_status():
    for exc in (InvalidArgument("bad input 'x'", where="model 'm'", fix="send x"), NotFound("no model 'm'"),
                Rejected("Exceeds maximum queue size"), ResourceExhausted("slow down", retry_after_s=2.5),
                KeyError("oops")):
        back = ipc.rebuild_error(ipc.error_tuple(exc))
        if isinstance(exc, KeyError):
            assert back.status == "INTERNAL" and "KeyError" in back.message
            continue
        assert back.status == exc.status and back.message == exc.message and back.where == exc.where
        assert back.fix == exc.fix
    assert ipc.rebuild_error(ipc.error_tuple(ResourceExhausted("slow", retry_after_s=2.5))).retry_after_s == 2.5


class _CountingSocket(socket.socket):
    """A real socket that counts its receive calls (what the channel costs per frame)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self.recvs = 0

    def recv_into(self, *args):
        self.recvs += 1
        return super().recv_into(*args)


def test_channel_one_receive_per_frame_and_payloads_never_reused():
    mine, theirs = socket.socketpair()
    counted = _CountingSocket(theirs)
    chan = ipc.Channel(counted, size=256)
    try:
        kept = []
        for i in range(5):  # a request/answer crossing: each frame sent alone, received with ONE recv
            ipc.send_frame(mine, ("x", i, [("a", 0)]), [np.full(8, i, np.float32).tobytes()])
            before = counted.recvs
            header, payload = chan.recv()
            assert header == ("x", i, [("a", 0)]) and counted.recvs == before + 1
            kept.append(payload)
        # a payload given out stays what it was while later frames arrive (it is never the reused buffer)
        assert [np.frombuffer(p, np.float32).tolist() for p in kept] == [[float(i)] * 8 for i in range(5)]
        # a frame larger than the buffer, and frames cut anyhow or sent together, come out whole and once
        big = np.arange(10_000, dtype=np.int64)
        data = b"".join(bytes(p) for f in [(("big",), [big.tobytes()]), (("o", 1),), (("p", 2), [b"xyz"])]
                        for p in ipc.frame(*f))
        writer = threading.Thread(target=lambda: [mine.sendall(data[i:i + 777]) for i in range(0, len(data), 777)])
        writer.start()
        assert (lambda h, p: (h, np.frombuffer(p, np.int64).tolist()))(*chan.recv()) == (("big",), big.tolist())
        assert chan.recv() == (("o", 1), memoryview(b""))
        header, payload = chan.recv()
        assert header == ("p", 2) and bytes(payload) == b"xyz"
        writer.join()
        # without waiting (an event loop's reader callback): None until the whole frame is there
        assert chan.try_recv() is None
        data = b"".join(bytes(p) for p in ipc.frame(("q", 3), [big.tobytes()]))
        mine.sendall(data[:5000])
        assert chan.try_recv() is None
        mine.sendall(data[5000:])
        header, payload = chan.try_recv()
        assert header == ("q", 3) and bytes(payload) == big.tobytes() and chan.try_recv() is None
        mine.close()
        with pytest.raises(ConnectionError):
            chan.recv()
    finally:
        mine.close()
        counted.close()


def test_a_batch_of_requests_crosses_as_one_block_per_input():
    arena = shm_ring.Arena(1 << 16)
    try:
        batch = [{"x": np.arange(k * 4, dtype=np.float32).reshape(k, 4) + k, "n": np.full((k, 1), k, np.int64)}
                 for k in (1, 3, 2)]
        packed = shm_ring.Packed()
        desc = ipc.pack_dicts(arena, batch, packed)
        assert desc[0] == "rows" and len(packed.refs) == 2 and [r[0] for r in packed.refs] == ["s", "s"]
        back = ipc.unpack_dicts(arena.view, ipc._EMPTY, desc, packed.refs, copy=True)
        arena.view[:] = b"\xff" * len(arena.view)  # copies own their data: the writer may reuse its arena
        assert len(back) == 3
        for got, sent in zip(back, batch):
            assert sorted(got) == sorted(sent)
            for name in sent:
                assert got[name].dtype == sent[name].dtype and (got[name] == sent[name]).all()

        # what cannot be stacked goes per tensor: BYTES, other trailing shapes, different names, 0-d
        odd = [[{"t": np.array([b"ab", b"c"], dtype=np.object_)}, {"t": np.array([b"d"], dtype=np.object_)}],
               [{"x": np.ones((1, 4), np.float32)}, {"x": np.ones((1, 5), np.float32)}],
               [{"x": np.ones((1, 4), np.float32)}, {"y": np.ones((1, 4), np.float32)}],
               [{"s": np.float32(2.5) * np.ones(())}], [{}, {}]]
        for dicts in odd:
            arena.reset()
            packed = shm_ring.Packed()
            desc = ipc.pack_dicts(arena, dicts, packed)
            assert desc[0] == "each"
            back = ipc.unpack_dicts(arena.view, ipc._EMPTY, desc, packed.refs, copy=True)
            assert [sorted(d) for d in back] == [sorted(d) for d in dicts]
            for got, sent in zip(back, dicts):
                for name in sent:
                    assert got[name].shape == sent[name].shape and (got[name] == sent[name]).all()

        # no room in the arena for x (96 bytes): its stacked block goes inline after the header; n fits
        tiny = shm_ring.Arena(64)
        try:
            packed = shm_ring.Packed()
            desc = ipc.pack_dicts(tiny, batch, packed)
            assert desc[0] == "rows" and [r[0] for r in packed.refs] == ["i", "s"]
            inline = memoryview(b"".join(bytes(p) for p in packed.inline))
            back = ipc.unpack_dicts(tiny.view, inline, desc, packed.refs, copy=False)
            assert all((g["x"] == s["x"]).all() and (g["n"] == s["n"]).all() for g, s in zip(back, batch))
        finally:
            tiny.close()
    finally:
        arena.close()


def test_a_batch_of_one_request_crosses_exactly_whatever_its_arrays_layout():
    # one request (every batch at concurrency 1) takes put_rows' direct copy when C-contiguous, the
    # concatenate otherwise: each array back bit for bit, row-major, with its own dtype and shape
    arena = shm_ring.Arena(1 << 16)
    try:
        base = np.arange(24, dtype=np.float64).reshape(4, 6)
        request = {"c": np.arange(8, dtype=np.float32).reshape(1, 8) - 3.5, "t": base.T[:, :4],  # (6, 4): a strided view
                   "f": np.asfortranarray(base), "b": np.array([[True, False, True]]),
                   "o": np.arange(6, dtype=np.int16).reshape(2, 3)[:, ::2]}
        assert not request["t"].flags.c_contiguous and not request["o"].flags.c_contiguous
        packed = shm_ring.Packed()
        desc = ipc.pack_dicts(arena, [request], packed)
        assert desc[0] == "rows" and {r[0] for r in packed.refs} == {"s"}
        (back,) = ipc.unpack_dicts(arena.view, ipc._EMPTY, desc, packed.refs, copy=True)
        for name, sent in request.items():
            got = back[name]
            assert got.dtype == sent.dtype and got.shape == sent.shape
            assert got.tobytes() == np.ascontiguousarray(sent).tobytes(), name
    finally:
        arena.close()


def test_a_batch_of_one_request_crosses_inline_with_bytes_and_with_no_rows():
    # one request whose arrays do not fit the arena travel inline; one holding a BYTES tensor leaves the
    # rows layout for one descriptor per array; an array of zero rows crosses as itself
    small = shm_ring.Arena(64)
    try:
        request = {"x": np.arange(32, dtype=np.float32).reshape(2, 16), "e": np.zeros((0, 3), np.int64)}
        packed = shm_ring.Packed()
        desc = ipc.pack_dicts(small, [request], packed)
        assert desc[0] == "rows" and [r[0] for r in packed.refs] == ["i", "i"]
        (back,) = ipc.unpack_dicts(small.view, memoryview(b"".join(bytes(p) for p in packed.inline)), desc,
                                   packed.refs, copy=True)
        assert back["x"].tobytes() == request["x"].tobytes() and back["e"].shape == (0, 3)
        assert back["e"].dtype == np.int64
    finally:
        small.close()
    arena = shm_ring.Arena(1 << 16)
    try:
        request = {"s": np.array([[b"ab", b""]], dtype=np.object_), "n": np.array([[7, 8]], np.uint8)}
        packed = shm_ring.Packed()
        desc = ipc.pack_dicts(arena, [request], packed)
        assert desc[0] == "each"
        (back,) = ipc.unpack_dicts(arena.view, ipc._EMPTY, desc, packed.refs, copy=True)
        assert back["s"].tolist() == [[b"ab", b""]] and back["n"].tolist() == [[7, 8]]
    finally:
        arena.close()


@pytest.mark.parametrize("requests", [1, 3])
def test_arrays_of_any_layout_cross_inline_when_the_arena_is_full(requests):
    # a model's outputs larger than its arena travel inline (put_rows' fallback): a transposed or strided
    # output must cross there as it does through the arena, not stop the instance process with a TypeError
    full = shm_ring.Arena(64)
    try:
        base = np.arange(60, dtype=np.float32).reshape(6, 10)
        batch = [{"t": (base + i).T, "s": (base - i)[:, ::3], "f": np.asfortranarray(base * i)} for i in range(requests)]
        assert not any(a.flags.c_contiguous for d in batch for a in d.values())
        packed = shm_ring.Packed()
        desc = ipc.pack_dicts(full, batch, packed)
        assert desc[0] == "rows" and {r[0] for r in packed.refs} == {"i"}
        inline = memoryview(b"".join(bytes(p) for p in packed.inline))
        back = ipc.unpack_dicts(full.view, inline, desc, packed.refs, copy=True)
        for got, sent in zip(back, batch, strict=True):
            for name, array in sent.items():
                assert got[name].shape == array.shape and got[name].dtype == array.dtype
                assert got[name].tobytes() == np.ascontiguousarray(array).tobytes(), name
    finally:
        full.close()
