"""The HTTP/2 connection protocol itself (serve/grpc_h2.py) on a real event loop and socket: however the
kernel cuts the client's bytes into reads (whole frames, frames split anywhere, one byte at a time), the
calls are answered, in full, with the same bytes."""

from __future__ import annotations

import asyncio
import socket

import pytest
from hpack import Encoder

from azulite.serve.grpc_h2 import GrpcH2Server, _H2Connection
from azulite.serve.grpc_h2_calls import _unary_answer
from azulite.serve.h2_frames import (ACK, DATA, END_HEADERS, END_STREAM, HEADERS, PREFACE, SETTINGS, _GRPC_PREFIX,
                                     _frame)
from azulite.serve.proto import service_pb2 as pb

_PATH = "/inference.GRPCInferenceService/ModelReady"


def _client_bytes(names: list[str]) -> bytes:
    encoder = Encoder()
    out = [PREFACE, _frame(SETTINGS, 0, 0)]
    for i, name in enumerate(names):
        sid = 2 * i + 1
        headers = [(":method", "POST"), (":scheme", "http"), (":path", _PATH), (":authority", "x"),
                   ("content-type", "application/grpc"), ("te", "trailers")]
        message = pb.ModelReadyRequest(name=name).SerializeToString()
        out.append(_frame(HEADERS, END_HEADERS, sid, encoder.encode(headers)))
        out.append(_frame(DATA, END_STREAM, sid, _GRPC_PREFIX.pack(0, len(message)) + message))
    return b"".join(out)


async def _ready(request, context):
    return pb.ModelReadyResponse(ready=request.name.startswith("yes"))


@pytest.mark.parametrize("cut", ["whole", "halves", "every_7", "bytes"])
def test_calls_are_answered_however_the_reads_cut_the_frames(cut):
    async def main():
        server = GrpcH2Server(None)
        server.methods = {_PATH: (pb.ModelReadyRequest, _ready, False, None)}
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        transport, conn = await loop.connect_accepted_socket(lambda: _H2Connection(server), sock=ours)
        reader, writer = await asyncio.open_connection(sock=theirs)
        names = ["yes-a", "no-b", "yes-" + "c" * 3000, "no"]
        data = _client_bytes(names)
        step = {"whole": len(data), "halves": len(data) // 2 + 1, "every_7": 7, "bytes": 1}[cut]
        for i in range(0, len(data), step):
            conn.data_received(data[i:i + step])  # each slice one read
        settings = await asyncio.wait_for(reader.readexactly(9), 30)  # our SETTINGS, then its payload
        await asyncio.wait_for(reader.readexactly(int.from_bytes(settings[:3], "big")), 30)
        await asyncio.wait_for(reader.readexactly(13), 30)  # the connection WINDOW_UPDATE
        assert await asyncio.wait_for(reader.readexactly(9), 30) == _frame(SETTINGS, ACK, 0)
        for i, name in enumerate(names):
            want = _unary_answer(2 * i + 1, pb.ModelReadyResponse(ready=name.startswith("yes")).SerializeToString())
            assert await asyncio.wait_for(reader.readexactly(len(want)), 30) == want, (cut, name)
        assert conn.completed == len(names) and not conn.buf and server.in_flight == 0
        writer.close()
        transport.close()

    asyncio.run(main())
