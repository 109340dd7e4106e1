"""Hostile clients against the HTTP/1.1 and HTTP/2 (gRPC) transports, with raw sockets and the ``h2``
library: every case ends with the offending connection cut off and a well-behaved client's requests all
completing (tritonclient over HTTP and gRPC, during the attack and after). The server runs with short
timeouts (one second) so that the cases end quickly; the tests wait on the server closing, never on time.
"""

from __future__ import annotations

import socket
import struct
import time

import h2.config
import h2.connection
import h2.events
import h2.settings
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hpack import Encoder
from tritonclient.grpc import service_pb2 as pb

from azulite.serve.limits import ConnectionLimits

from .conftest import build_model_repository
from .frontends import running_server

LIMITS = ConnectionLimits(header_timeout_s=1.0, stall_timeout_s=1.0, max_message_bytes=1 << 20,
                          max_buffered_bytes=4 << 20, max_write_buffer=256 * 1024)
GOAWAY, ENHANCE_YOUR_CALM = 7, 0xB
X = np.arange(16, dtype=np.float32).reshape(1, 16)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = build_model_repository(tmp_path_factory.mktemp("hostile_repo"), ("add_sub_onnx",))
    with running_server(repo, limits=LIMITS, http_max_input_size=1 << 20) as s:
        yield s


def well_behaved(server, n: int = 3) -> None:
    """Triton's own clients, both protocols: every request answered right."""
    for module, url in ((httpclient, server.http_url), (grpcclient, server.grpc_url)):
        client = module.InferenceServerClient(url)
        try:
            for _ in range(n):
                inputs = []
                for name in ("INPUT0", "INPUT1"):
                    i = module.InferInput(name, [1, 16], "FP32")
                    i.set_data_from_numpy(X)
                    inputs.append(i)
                np.testing.assert_array_equal(client.infer("add_sub_onnx", inputs).as_numpy("OUTPUT0"), X + X)
        finally:
            client.close()


def connect(url: str) -> socket.socket:
    host, port = url.split(":")
    return socket.create_connection((host, int(port)), timeout=60)


def read_until_closed(sock: socket.socket, timeout_s: float = 60.0) -> bytes:
    """Everything the server sends until it closes (the timeout is only a safety net)."""
    sock.settimeout(timeout_s)
    data = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except (ConnectionResetError, BrokenPipeError):
            break
        except socket.timeout:
            raise AssertionError(f"the server did not close the connection in {timeout_s:g} s") from None
        if not chunk:
            break
        data += chunk
    sock.close()
    return bytes(data)


def send_all(sock: socket.socket, data: bytes) -> None:
    """Send what the server takes; a server that closed mid-flood is the expected end."""
    try:
        sock.sendall(data)
    except (ConnectionResetError, BrokenPipeError):
        pass


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, pos = [], 0
    while len(data) - pos >= 9:
        hi, lo, ftype, flags, sid = struct.unpack_from(">HBBBL", data, pos)
        n = (hi << 8) | lo
        out.append((ftype, flags, sid & 0x7FFFFFFF, data[pos + 9:pos + 9 + n]))
        pos += 9 + n
    return out


def goaway_code(data: bytes) -> int | None:
    for ftype, _, _, payload in frames(data):
        if ftype == GOAWAY:
            return struct.unpack(">L", payload[4:8])[0]
    return None


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">HBBBL", n >> 8, n & 0xFF, ftype, flags, sid) + payload


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0)  # + an empty SETTINGS
GRPC_HEADERS = [(":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ModelInfer"),
                (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")]


def infer_message() -> bytes:
    request = pb.ModelInferRequest(model_name="add_sub_onnx")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        request.raw_input_contents.append(X.tobytes())
    body = request.SerializeToString()
    return struct.pack(">BL", 0, len(body)) + body


def grpc_status_of(conn: h2.connection.H2Connection, s: socket.socket) -> dict:
    """The headers carrying the one stream's grpc-status (trailers, or a trailers-only answer); closes ``s``."""
    s.settimeout(60)
    try:
        while True:
            chunk = s.recv(1 << 16)
            assert chunk, "closed without answering the stream"
            for e in conn.receive_data(chunk):
                if isinstance(e, (h2.events.TrailersReceived, h2.events.ResponseReceived)) and \
                        any(k == b"grpc-status" for k, _ in e.headers):
                    return dict(e.headers)
    finally:
        s.close()


def h2_client(settings: dict | None = None) -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    if settings:
        conn.update_settings(settings)
    return conn


def rss_mb(server) -> float:
    return psutil.Process().memory_info().rss / 2**20


# --- HTTP/1.1 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("start, says", [
    (b"POST /v2/models/add_sub_onnx/infer HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"request head did not arrive"),
    # a head sent whole, then a body that never ends (or a byte now and then, slower than the timeout): it
    # held its connection forever, and enough of them every connection a server allows
    (b"POST /v2/models/add_sub_onnx/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 196\r\n\r\n{",
     b"request body stopped arriving"),
], ids=["head", "body"])
def test_slow_requests_are_cut_off(server, start, says):
    socks = []
    for _ in range(20):
        s = connect(server.http_url)
        s.sendall(start)
        socks.append(s)
    well_behaved(server)  # served while 20 requests hang
    for s in socks:
        answer = read_until_closed(s)
        assert b"408 Request Timeout" in answer and says in answer
    well_behaved(server)


def test_a_head_gets_its_whole_timeout(server):
    """The sweep cut heads off after half a timeout to one (two ticks of half a timeout each): never before
    the timeout now. Heads begun at five points of a tick (the sweep's phase is unknown), each answer
    timed as it comes. (A lower bound only: a slow machine makes it later, never earlier.)"""
    import selectors

    sel = selectors.DefaultSelector()
    began = {}
    for i in range(5):
        s = connect(server.http_url)
        began[s] = time.monotonic()
        s.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\n")  # the server's clock starts after this reaches it
        sel.register(s, selectors.EVENT_READ)
        time.sleep(LIMITS.header_timeout_s / 10)  # staggering the heads across a tick, not waiting on one
    took, answers = {}, {s: b"" for s in began}
    while len(took) < len(began):
        events = sel.select(timeout=60)
        assert events, "the server did not answer the heads in 60 s"
        for key, _ in events:
            chunk = key.fileobj.recv(4096)
            answers[key.fileobj] += chunk
            if not chunk:
                took[key.fileobj] = time.monotonic() - began[key.fileobj]
                sel.unregister(key.fileobj)
                key.fileobj.close()
    assert all(b"408 Request Timeout" in a for a in answers.values())
    assert min(took.values()) >= LIMITS.header_timeout_s, sorted(took.values())


def test_idle_connections_make_room_at_max_connections(tmp_path):
    """At --max-connections, a new connection was refused (503) while the ones held open sat idle: a client
    keeping idle keep-alive connections kept everyone out, liveness probes included. The idle one goes."""
    import dataclasses

    repo = build_model_repository(tmp_path / "repo", ("add_sub_onnx",))
    limits = dataclasses.replace(LIMITS, max_connections=2)
    with running_server(repo, limits=limits) as s:
        idle = []
        for _ in range(2):  # each answered once, then held open doing nothing
            c = connect(s.http_url)
            c.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert c.recv(4096).startswith(b"HTTP/1.1 200 ")
            idle.append(c)
        probes = []
        for _ in range(2):  # each evicts the connection idle longest: the two held first, in turn
            probe = connect(s.http_url)
            probe.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert probe.recv(4096).startswith(b"HTTP/1.1 200 ")
            probes.append(probe)
        closed = [read_until_closed(c) for c in idle]  # the server closed them (each without a word)
        assert closed == [b"", b""]
        for probe in probes:
            probe.close()


@pytest.mark.parametrize("attack, answer", [
    (b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (100 * 1024) + b"\r\n\r\n", b"431 "),
    (b"POST /v2/models/add_sub_onnx/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n", b"413 "),
    (b"POST /v2/models/add_sub_onnx/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     + (b"10000\r\n" + b"x" * 0x10000 + b"\r\n") * 40, b"413 "),
    (b"GARBAGE\x00\x01 / HTTP/9\r\n\r\n", b"400 "),
    (b"GET /v2 HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", b"400 "),
])
def test_oversized_and_malformed_requests_are_answered_and_closed(server, attack, answer):
    s = connect(server.http_url)
    send_all(s, attack)
    reply = read_until_closed(s)
    assert reply.startswith(b"HTTP/1.1 " + answer), reply[:200]
    well_behaved(server, 1)


def test_pipelining_without_reading_is_paused_then_cut_off(server):
    http = server.server.http
    before = set(http.connections)
    s = connect(server.http_url)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(5)
    request = b"GET /v2/models/add_sub_onnx/config HTTP/1.1\r\nHost: x\r\n\r\n"
    rss = rss_mb(server)
    try:
        for _ in range(200):  # ~10 MB of requests; the server stops reading long before
            s.sendall(request * 1000)
    except (socket.timeout, ConnectionResetError, BrokenPipeError):
        pass  # the server stopped reading: the kernel buffers filled
    [conn] = [c for c in http.connections if c not in before] or [None]
    if conn is not None:  # still open: its queue of answers and the requests it runs are bounded
        assert len(conn.replies) <= LIMITS.max_pipelined
        assert http.in_flight <= LIMITS.max_pipelined
    well_behaved(server)
    deadline = time.monotonic() + 60
    while set(http.connections) - before:  # cut off once its answers went unread for stall_timeout_s
        assert time.monotonic() < deadline, "the server kept a connection whose answers went unread"
        time.sleep(0.05)
    s.close()
    assert rss_mb(server) - rss < 100
    well_behaved(server)


# --- HTTP/2 (gRPC) ----------------------------------------------------------------------------------------


def test_rapid_reset_is_cut_off(server):
    """CVE-2023-44487: open streams and cancel them at once, over and over."""
    conn = h2_client()
    s = connect(server.grpc_url)
    s.sendall(conn.data_to_send())
    burst = bytearray()
    for i in range(2000):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, GRPC_HEADERS)
        conn.reset_stream(sid)
        burst += conn.data_to_send()
    well_behaved(server, 1)
    send_all(s, bytes(burst))
    assert goaway_code(read_until_closed(s)) == ENHANCE_YOUR_CALM
    well_behaved(server)


def test_continuation_flood_is_cut_off(server):
    """CVE-2024-27316 family: a header block that never ends, in empty CONTINUATION frames."""
    block = Encoder().encode(GRPC_HEADERS)
    s = connect(server.grpc_url)
    attack = PREFACE + frame(1, 0, 1, block[:5]) + frame(9, 0, 1) * 10_000
    send_all(s, attack)
    assert goaway_code(read_until_closed(s)) == ENHANCE_YOUR_CALM
    # and a header block that grows without end
    s = connect(server.grpc_url)
    send_all(s, PREFACE + frame(1, 0, 1, block) + frame(9, 0, 1, b"\x00" * 16000) * 10)
    assert goaway_code(read_until_closed(s)) == ENHANCE_YOUR_CALM
    well_behaved(server)


def test_hpack_bomb_is_cut_off(server):
    """A small block that decodes to a huge header list: one 4 KB header in the dynamic table, then
    the same index referenced thousands of times."""
    encoder = Encoder()
    first = encoder.encode(GRPC_HEADERS + [("x-bomb", "b" * 4000)])  # indexed: enters the dynamic table
    bomb = encoder.encode(GRPC_HEADERS) + b"\xbe" * 2000  # index 62: the newest dynamic entry, 2000 times
    s = connect(server.grpc_url)
    send_all(s, PREFACE + frame(1, 0x4, 1, first) + frame(1, 0x4 | 0x1, 3, bomb))
    code = goaway_code(read_until_closed(s))
    assert code in (0x9, ENHANCE_YOUR_CALM)  # COMPRESSION_ERROR: the list passes the advertised limit
    well_behaved(server)


@pytest.mark.parametrize("flood", [frame(4, 0, 0), frame(6, 0, 0, b"12345678"), frame(8, 0, 0, b"\x00\x00\x00\x01"),
                                   frame(2, 0, 1, b"\x00\x00\x00\x00\x10")],
                         ids=["settings", "ping", "window_update", "priority"])
def test_control_frame_floods_are_cut_off(server, flood):
    s = connect(server.grpc_url)
    send_all(s, PREFACE + flood * (LIMITS.max_control_frames + 100))
    data = read_until_closed(s)
    assert goaway_code(data) == ENHANCE_YOUR_CALM or len(data) < 1 << 20  # GOAWAY, or aborted unread
    well_behaved(server)


def test_zero_window_stall_is_cut_off(server):
    """The client grants no flow-control window: answers wait for it, then the connection closes."""
    conn = h2_client({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    s = connect(server.grpc_url)
    for _ in range(5):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, GRPC_HEADERS)
        conn.send_data(sid, infer_message(), end_stream=True)
    s.sendall(conn.data_to_send())
    well_behaved(server)
    data = read_until_closed(s)
    assert goaway_code(data) == ENHANCE_YOUR_CALM
    assert not any(ftype == 0 and payload for ftype, _, _, payload in frames(data))  # no DATA was sent
    well_behaved(server)


def test_silent_connection_is_cut_off(server):
    """Slowloris over HTTP/2: a connection that never sends its preface."""
    s = connect(server.grpc_url)
    s.sendall(b"PRI * HTTP/2.0\r\n")
    read_until_closed(s)
    s = connect(server.grpc_url)
    send_all(s, b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100)  # not HTTP/2 at all
    read_until_closed(s)
    well_behaved(server)


def test_oversized_messages_are_refused_and_buffering_is_bounded(server):
    conn = h2_client()
    s = connect(server.grpc_url)
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, GRPC_HEADERS)
    huge = struct.pack(">BL", 0, 100 << 20) + b"\x00" * (LIMITS.max_message_bytes + 1024)
    s.sendall(conn.data_to_send())
    raw = bytearray()
    for i in range(0, len(huge), 16384):
        raw += frame(0, 0, sid, huge[i:i + 16384])
    send_all(s, bytes(raw))
    s.settimeout(60)
    received = b""
    while b"grpc-status" not in received and b"RESOURCE" not in received:
        chunk = s.recv(1 << 16)
        assert chunk, "closed without answering the stream"
        received += chunk
        events = conn.receive_data(chunk)
        if any(isinstance(e, h2.events.TrailersReceived) or isinstance(e, h2.events.ResponseReceived)
               and any(k == b"grpc-status" for k, _ in e.headers) for e in events):
            break
    statuses = [dict(e.headers).get(b"grpc-status") for e in events
                if isinstance(e, (h2.events.TrailersReceived, h2.events.ResponseReceived))]
    assert b"8" in statuses  # RESOURCE_EXHAUSTED
    s.close()
    # many streams each holding most of a message: the connection's buffer limit cuts it off
    conn = h2_client()
    s = connect(server.grpc_url)
    attack = bytearray(conn.data_to_send())
    part = struct.pack(">BL", 0, 900 << 10) + b"\x00" * (899 << 10)
    for _ in range(8):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, GRPC_HEADERS)
        attack += conn.data_to_send()
        for i in range(0, len(part), 16384):
            attack += frame(0, 0, sid, part[i:i + 16384])
    send_all(s, bytes(attack))
    assert goaway_code(read_until_closed(s)) == ENHANCE_YOUR_CALM
    well_behaved(server)


def test_a_unary_request_that_stops_arriving_is_answered_and_forgotten(server):
    """HEADERS, then a message prefix announcing one byte that never comes, no END_STREAM: the stream and its
    buffer were held for good (HTTP/1.1's body timeout had no gRPC counterpart)."""
    conn = h2_client()
    s = connect(server.grpc_url)
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, GRPC_HEADERS)
    conn.send_data(sid, struct.pack(">BL", 0, 1))
    s.sendall(conn.data_to_send())
    well_behaved(server)  # served meanwhile
    trailers = grpc_status_of(conn, s)
    assert trailers[b"grpc-status"] == b"4", trailers  # DEADLINE_EXCEEDED
    well_behaved(server)


def test_a_message_declared_past_the_limit_is_refused_by_its_prefix(server):
    """A message's 5-byte prefix declaring more than --grpc-max-message-bytes, its body far smaller: the size
    was checked only on bodies past 64 KiB (a 12 KB message passed a 4 KiB limit), and this one was
    answered "a unary call carries exactly one message, got 0"."""
    conn = h2_client()
    s = connect(server.grpc_url)
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, GRPC_HEADERS)
    conn.send_data(sid, struct.pack(">BL", 0, LIMITS.max_message_bytes + 1) + b"abc", end_stream=True)
    s.sendall(conn.data_to_send())
    trailers = grpc_status_of(conn, s)
    assert trailers[b"grpc-status"] == b"8", trailers  # RESOURCE_EXHAUSTED
    assert b"--grpc-max-message-bytes" in trailers[b"grpc-message"]


@pytest.mark.parametrize("extra", [[(":foo", "1")], [("connection", "close")], [("X-Upper", "1")],
                                   [("te", "gzip")]], ids=["pseudo", "connection", "upper", "te"])
def test_a_malformed_request_is_reset_with_protocol_error(server, extra):
    """RFC 9113 8.2-8.3: an unknown pseudo-header, a connection-specific field, an upper-case name, a ``te``
    other than trailers make a request malformed, a stream error PROTOCOL_ERROR; they were served."""
    config = h2.config.H2Configuration(client_side=True, header_encoding=None, validate_outbound_headers=False,
                                       normalize_outbound_headers=False)
    conn = h2.connection.H2Connection(config)
    conn.initiate_connection()
    s = connect(server.grpc_url)
    sid = conn.get_next_available_stream_id()
    # a pseudo-header among the request's own (before the regular fields), a field after them
    headers = GRPC_HEADERS[:4] + extra + GRPC_HEADERS[4:] if extra[0][0].startswith(":") else GRPC_HEADERS + extra
    conn.send_headers(sid, headers)
    conn.send_data(sid, infer_message(), end_stream=True)
    s.sendall(conn.data_to_send())
    s.settimeout(60)
    reset = None
    while reset is None:
        chunk = s.recv(1 << 16)
        assert chunk, "closed without answering the stream"
        for e in conn.receive_data(chunk):
            assert not isinstance(e, h2.events.ResponseReceived), "the malformed request was answered"
            if isinstance(e, h2.events.StreamReset):
                reset = e.error_code
    s.close()
    assert reset == 1  # PROTOCOL_ERROR
    well_behaved(server)


def test_too_many_concurrent_streams_are_refused(server):
    encoder = Encoder()
    s = connect(server.grpc_url)
    data = bytearray(PREFACE)
    for i in range(LIMITS.max_streams + 10):  # streams whose requests never end (raw: h2 would stop us)
        data += frame(1, 0x4, 2 * i + 1, encoder.encode(GRPC_HEADERS))
    send_all(s, bytes(data))
    s.settimeout(60)
    refused, buf = 0, b""
    while refused < 10:
        chunk = s.recv(1 << 16)
        assert chunk, "closed instead of refusing streams"
        buf += chunk
        refused = sum(1 for ftype, _, _, payload in frames(buf) if ftype == 3 and payload == b"\x00\x00\x00\x07")
    s.close()
    well_behaved(server)
