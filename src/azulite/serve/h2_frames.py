"""HTTP/2 framing for azulite's gRPC transport (grpc_h2.py): frame types and flags, the frame header,
and the few fixed HPACK blocks the server sends (literals without indexing: the peer's dynamic table is
never touched)."""

from __future__ import annotations

import struct
from urllib.parse import quote

import grpc

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
_FRAME = struct.Struct(">HBBBL")  # 24-bit length as (high 16, low 8), type, flags, stream id
_U32 = struct.Struct(">L")
_GRPC_PREFIX = struct.Struct(">BL")
RECV_WINDOW = (1 << 31) - 1
MAX_FRAME = 1 << 20  # what we accept; we send at most the peer's own limit
HEADER_LIST_LIMIT = 1 << 16
SERVICE = "/inference.GRPCInferenceService/"


def _frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 8, n & 0xFF, ftype, flags, stream) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header as 'literal without indexing, new name' (never touches the peer's dynamic table)."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


_RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + _hpack_int(16, 7) + b"application/grpc"  # :status 200, content-type
_OK_TRAILERS = _literal(b"grpc-status", b"0")


def _status_block(code: grpc.StatusCode, message: str, metadata=()) -> bytes:
    """grpc-status, grpc-message and any trailing ``metadata`` ((key, value) str pairs: lower-case ASCII
    keys, printable values — the server's own, e.g. retry-after)."""
    block = (_literal(b"grpc-status", str(code.value[0]).encode())
             + _literal(b"grpc-message", quote(message, safe=" !#$&'()*+,/:;=?@[]~").encode()))
    for key, value in metadata:
        block += _literal(key.encode("ascii"), value.encode("ascii"))
    return block
