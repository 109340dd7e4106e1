"""Frames between azulite's processes: whatever way the stream cuts them, each frame comes out whole and
once; errors cross as the same class and status."""

from __future__ import annotations

from azulite.errors import InvalidArgument, NotFound, ResourceExhausted
from azulite.serve import ipc
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
