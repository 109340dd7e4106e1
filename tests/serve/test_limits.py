"""Connection limits (serve/limits.py): the flag values are validated with errors naming the flag, a
connection past --max-connections is refused (503 / GOAWAY) while the others are served, and the gRPC
message limit holds on both gRPC transports (grpc.aio takes it as its channel option)."""

from __future__ import annotations

import socket
import time

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from azulite.errors import SpecError
from azulite.serve.limits import FLAGS, ConnectionLimits, limits_from_flags

from .conftest import build_model_repository
from .frontends import running_server
from .test_hostile import PREFACE, connect, frames, goaway_code, read_until_closed

GET_LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"


def test_flags_build_limits_and_bad_values_name_the_flag():
    limits = limits_from_flags({"max_streams": 8, "header_timeout_s": 2, "max_connections": None})
    assert (limits.max_streams, limits.header_timeout_s, limits.max_connections) == (8, 2.0, 0)
    assert limits_from_flags({}) == ConnectionLimits()
    for values, flag in (({"max_streams": 0}, "--max-concurrent-streams"),
                         ({"header_timeout_s": -1.0}, "--header-timeout-secs"),
                         ({"stall_timeout_s": float("nan")}, "--stall-timeout-secs"),
                         ({"max_header_bytes": 100}, "--max-header-bytes"),
                         ({"max_connections": -1}, "--max-connections"),
                         ({"max_message_bytes": 1 << 30}, "--grpc-max-message-bytes")):
        with pytest.raises(SpecError) as info:
            limits_from_flags(values)
        assert info.value.field == flag and "fix" in str(info.value)
    # a limit only azulite's HTTP/2 transport has: with grpcio it would do nothing, so it is refused
    with pytest.raises(SpecError, match="--grpc-impl grpcio cannot enforce --rapid-reset-allowance"):
        limits_from_flags({"reset_allowance": 5}, grpc_impl="grpcio")
    assert limits_from_flags({"max_streams": 8}, grpc_impl="grpcio").max_streams == 8
    assert len(FLAGS) == len(set(FLAGS.values()))


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return build_model_repository(tmp_path_factory.mktemp("limits_repo"), ("add_sub_onnx",))


def _read(sock: socket.socket, enough) -> bytes:
    data = b""
    while not enough(data):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _live(sock: socket.socket) -> bool:
    """A request on the connection, answered 200 (the server took the connection)."""
    try:
        sock.sendall(GET_LIVE)
        return _read(sock, lambda d: b"\r\n\r\n" in d).startswith(b"HTTP/1.1 200")
    except OSError:  # refused: closed (a reset when our request crossed the server's close)
        return False


def _http_open(url: str) -> socket.socket:
    sock = connect(url)
    assert _live(sock)
    return sock


def _h2_open(url: str) -> socket.socket:
    sock = connect(url)
    sock.sendall(PREFACE)
    assert frames(_read(sock, lambda d: len(d) >= 9))[0][0] == 4  # the server's SETTINGS: it took the connection
    return sock


def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    """The server drops a closed connection from its count when the loop sees it go: wait for that
    (the timeout is only a safety net)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_connections_past_the_limit_are_refused_the_others_served(repo):
    with running_server(repo, limits=ConnectionLimits(max_connections=2)) as s:
        held = [_http_open(s.http_url), _http_open(s.http_url)]
        for sock in held:  # each with a request under way: an idle one would make room (the longest idle goes)
            sock.sendall(GET_LIVE[:-2])
        answer = read_until_closed(connect(s.http_url))
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer and b"too many open connections" in answer
        for sock in held:  # the two connections are still served
            sock.sendall(b"\r\n")
            assert _read(sock, lambda d: b"\r\n\r\n" in d).startswith(b"HTTP/1.1 200")
        held.pop().close()

        def http_accepts() -> bool:
            with connect(s.http_url) as sock:
                return _live(sock)

        _until(http_accepts, "a freed connection slot was not reused")
        # gRPC (azulite's HTTP/2): the extra connection gets GOAWAY ENHANCE_YOUR_CALM before any stream
        h2 = [_h2_open(s.grpc_url), _h2_open(s.grpc_url)]
        data = read_until_closed(connect(s.grpc_url))  # sending nothing: the answer is not lost to a reset
        assert goaway_code(data) == 0xB and b"too many connections" in data
        for sock in h2 + held:
            sock.close()


@pytest.mark.parametrize("grpc_impl", ["h2", "grpcio"])
def test_grpc_message_limit_holds_on_both_transports(repo, grpc_impl):
    limits = ConnectionLimits(max_message_bytes=64 * 1024, max_buffered_bytes=1 << 20)
    with running_server(repo, grpc_impl=grpc_impl, limits=limits) as s:
        channel = grpc.insecure_channel(s.grpc_url)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="add_sub_onnx")
        for name in ("INPUT0", "INPUT1"):
            request.inputs.add(name=name, datatype="FP32", shape=[1, 16])
            request.raw_input_contents.append(np.zeros(16, np.float32).tobytes())
        assert stub.ModelInfer(request, timeout=60).model_name == "add_sub_onnx"  # a small one passes
        request.id = "x" * (100 * 1024)  # past 64 KiB
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        channel.close()
