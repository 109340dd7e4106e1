"""The gRPC front-end, driven by tritonclient.grpc (sync, streaming and asyncio) and by the raw stub for
what the client library would never send, against the shared test repository on a real server."""

from __future__ import annotations

import asyncio
import queue
import socket
import struct
import time

import grpc
from hpack import Encoder
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from .conftest import Gate, bench_weights, tasks_created
from .frontends import running_server


@pytest.fixture(scope="module", params=["h2", "grpcio"])
def server(request, model_repository):
    """Both gRPC transports: azulite's HTTP/2 one (the default) and grpc.aio's."""
    with running_server(model_repository, grpc_impl=request.param) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.grpc_url)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def add_sub_inputs(x, y, names=("INPUT0", "INPUT1")):
    inputs = []
    for name, value in zip(names, (x, y)):
        i = grpcclient.InferInput(name, list(value.shape), "FP32")
        i.set_data_from_numpy(value)
        inputs.append(i)
    return inputs


def error_of(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta.name == "azulite" and "binary_tensor_data" in meta.extensions
    assert client.is_model_ready("add_sub_onnx")
    assert not client.is_model_ready("no_such_model")
    m = client.get_model_metadata("add_sub_pt")
    assert m.platform == "pytorch_libtorch"
    assert [i.name for i in m.inputs] == ["INPUT__0", "INPUT__1"] and list(m.inputs[0].shape) == [-1, 16]
    config = client.get_model_config("add_sub_onnx").config
    assert config.max_batch_size == 8 and list(config.input[0].dims) == [16]
    stats = client.get_inference_statistics("add_sub_onnx")
    assert stats.model_stats[0].name == "add_sub_onnx"
    index = {(m.name, m.version): m.state for m in client.get_model_repository_index().models}
    assert index[("versioned_py", "1")] == "READY" and index[("versioned_py", "2")] == "READY"


@pytest.mark.parametrize(("model", "ins", "outs"), [
    ("add_sub_onnx", ("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1")),
    ("add_sub_pt", ("INPUT__0", "INPUT__1"), ("OUTPUT__0", "OUTPUT__1")),
    ("add_sub_py", ("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1")),
])
def test_infer_add_sub(client, model, ins, outs):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    y = rng.standard_normal((2, 16)).astype(np.float32)
    result = client.infer(model, add_sub_inputs(x, y, ins), request_id="g-1",
                          outputs=[grpcclient.InferRequestedOutput(o) for o in outs])
    np.testing.assert_allclose(result.as_numpy(outs[0]), x + y, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy(outs[1]), x - y, rtol=1e-6)
    assert result.get_response().id == "g-1"


def test_infer_bytes_and_versions(client):
    text = np.array([[b"abc", b"Hello world"]], dtype=np.object_)
    i = grpcclient.InferInput("TEXT", [1, 2], "BYTES")
    i.set_data_from_numpy(text)
    result = client.infer("string_py", [i])
    assert result.as_numpy("UPPER").reshape(-1).tolist() == [b"ABC", b"HELLO WORLD"]
    assert result.as_numpy("LENGTH").tolist() == [[3, 11]]
    x = np.zeros(4, np.float32)
    for version in ("1", "2"):
        v = grpcclient.InferInput("INPUT0", [4], "FP32")
        v.set_data_from_numpy(x)
        out = client.infer("versioned_py", [v], model_version=version)
        np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), x + float(version))


def test_typed_contents_and_classification(stub):
    """tritonclient always sends raw contents; the protocol also allows typed ``contents``."""
    request = service_pb2.ModelInferRequest(model_name="add_sub_onnx")
    x = [float(v) for v in (0, 5, 1, 9, 3, 2, 7, 4, 8, 6, 0, 0, 0, 0, 0, 0)]
    for name, values in (("INPUT0", x), ("INPUT1", [0.0] * 16)):
        t = request.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        t.contents.fp32_contents.extend(values)
    out = request.outputs.add(name="OUTPUT0")
    out.parameters["classification"].int64_param = 2
    response = stub.ModelInfer(request, timeout=60)
    assert response.outputs[0].datatype == "BYTES"
    raw = response.raw_output_contents[0]
    items, pos = [], 0
    while pos < len(raw):
        n = int.from_bytes(raw[pos:pos + 4], "little")
        items.append(raw[pos + 4:pos + 4 + n].decode())
        pos += 4 + n
    assert [s.split(":")[1] for s in items] == ["3", "8"]


def test_typed_contents_out_of_range_are_invalid_argument(stub):
    request = service_pb2.ModelInferRequest(model_name="add_sub_onnx")
    t = request.inputs.add(name="INPUT0", datatype="INT8", shape=[1])
    t.contents.int_contents.append(300)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'INPUT0': contents do not fit INT8" in info.value.details()


def test_bench_model(client):
    x = np.linspace(0, 1, 256, dtype=np.float32).reshape(1, 256)
    i = grpcclient.InferInput("x", [1, 256], "FP32")
    i.set_data_from_numpy(x)
    np.testing.assert_allclose(client.infer("bench_matmul", [i]).as_numpy("y"), x @ bench_weights(),
                               rtol=1e-5, atol=1e-5)


def test_stream_infer(client):
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for k in range(6):
            x = np.full((1, 16), k, np.float32)
            client.async_stream_infer("add_sub_onnx", add_sub_inputs(x, x), request_id=str(k))
        bad = np.ones((1, 3), np.float32)
        client.async_stream_infer("add_sub_onnx", add_sub_inputs(bad, bad), request_id="bad")
        seen, errors = {}, []
        for _ in range(7):
            result, error = results.get(timeout=60)
            if error is not None:
                errors.append(error)
            else:
                seen[result.get_response().id] = result.as_numpy("OUTPUT0")
    finally:
        client.stop_stream()
    assert sorted(seen) == [str(k) for k in range(6)]
    for k, out in seen.items():
        np.testing.assert_array_equal(out, np.full((1, 16), 2 * int(k), np.float32))
    assert len(errors) == 1 and "INPUT0" in str(errors[0])


def test_asyncio_client(server):
    async def main():
        client = aiogrpcclient.InferenceServerClient(server.grpc_url)
        try:
            assert await client.is_server_ready()
            assert (await client.get_model_metadata("add_sub_py")).name == "add_sub_py"

            async def one(k):
                x = np.full((1, 16), k, np.float32)
                return (await client.infer("add_sub_py", add_sub_inputs(x, x))).as_numpy("OUTPUT1")

            outs = await asyncio.gather(*(one(k) for k in range(16)))
            assert all(np.all(o == 0) for o in outs)
        finally:
            await client.close()

    asyncio.run(main())


# --- errors and status codes ---------------------------------------------------------------------------


def test_bad_input_status_codes(client):
    x = np.ones((1, 16), np.float32)
    err = error_of(lambda: client.infer("add_sub_onnx", add_sub_inputs(x, x, ("INPUT0", "WRONG"))))
    assert err.status() == "StatusCode.INVALID_ARGUMENT" and "WRONG" in err.message()
    short = np.ones((1, 4), np.float32)
    err = error_of(lambda: client.infer("add_sub_onnx", add_sub_inputs(short, short)))
    assert err.status() == "StatusCode.INVALID_ARGUMENT" and "INPUT0" in err.message()
    ints = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in ints:
        i.set_data_from_numpy(np.ones((1, 16), np.int32))
    err = error_of(lambda: client.infer("add_sub_onnx", ints))
    assert err.status() == "StatusCode.INVALID_ARGUMENT" and "INT32" in err.message()
    err = error_of(lambda: client.infer("no_such_model", add_sub_inputs(x, x)))
    assert err.status() == "StatusCode.NOT_FOUND" and "no_such_model" in err.message()
    err = error_of(lambda: client.infer("add_sub_onnx", add_sub_inputs(x, x), model_version="9"))
    assert err.status() == "StatusCode.NOT_FOUND"
    err = error_of(lambda: client.get_model_config("no_such_model"))
    assert err.status() == "StatusCode.NOT_FOUND"


def test_raw_size_mismatch_is_invalid_argument(stub):
    request = service_pb2.ModelInferRequest(model_name="add_sub_onnx")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        request.raw_input_contents.append(b"\0" * 60)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "60" in info.value.details() and "64" in info.value.details()
    request.raw_input_contents.pop()
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "raw_input_contents" in info.value.details()


@pytest.mark.parametrize(("raw_count", "in_shm", "message"), [
    (2, 1, "raw_input_contents has 2 entries for 1 inputs not in shared memory"),
    (1, 0, "raw_input_contents has 1 entries for 2 inputs"),
    (3, 0, "raw_input_contents has 3 entries for 2 inputs"),
    (0, 2, None),  # both in shared memory: nothing raw, nothing refused
    (1, 1, None),
])
def test_raw_contents_must_match_the_inputs_not_in_shared_memory(raw_count, in_shm, message):
    """The codec alone (serve/grpc.py decode_infer_request), every mix of raw and shared-memory inputs."""
    from azulite.errors import InvalidArgument
    from azulite.serve.grpc import decode_infer_request

    request = service_pb2.ModelInferRequest(model_name="m", id="r")
    for i, name in enumerate(("INPUT0", "INPUT1")):
        t = request.inputs.add(name=name, datatype="FP32", shape=[1, 2])
        if i < in_shm:
            t.parameters["shared_memory_region"].string_param = "region"
            t.parameters["shared_memory_byte_size"].int64_param = 8
    for i in range(raw_count):
        request.raw_input_contents.append(np.array([[i, i + 0.5]], np.float32).tobytes())
    request.outputs.add(name="OUTPUT0").parameters["classification"].int64_param = 1
    if message is not None:
        with pytest.raises(InvalidArgument, match=message):
            decode_infer_request(request)
        return
    decoded = decode_infer_request(request)
    assert [t.name for t in decoded.inputs] == ["INPUT0", "INPUT1"] and decoded.id == "r"
    assert [t.data is None for t in decoded.inputs] == [True] * in_shm + [False] * (2 - in_shm)
    assert decoded.inputs[0].parameters.get("shared_memory_region") == ("region" if in_shm else None)
    if in_shm < 2:
        assert decoded.inputs[1].data.tolist() == [[0.0, 0.5]] and decoded.inputs[1].shape == (1, 2)
    assert [(o.name, o.parameters) for o in decoded.outputs] == [("OUTPUT0", {"classification": 1})]


def test_typed_contents_beside_raw_contents_are_refused_not_ignored():
    """An input with typed contents in a request that sends raw_input_contents: which of the two to read
    would be a guess (azulite read the raw ones and dropped the others); Triton refuses it in these words."""
    from azulite.errors import InvalidArgument
    from azulite.serve.grpc import decode_infer_request

    request = service_pb2.ModelInferRequest(model_name="add_sub_py")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="FP32", shape=[1, 2])
        request.raw_input_contents.append(np.ones(2, np.float32).tobytes())
    assert decode_infer_request(request).inputs[1].data.tolist() == [[1.0, 1.0]]
    request.inputs[1].contents.fp32_contents.extend([2.0, 2.0])
    with pytest.raises(InvalidArgument, match="contents field must not be specified when using raw_input_contents "
                                              "for 'INPUT1' for model 'add_sub_py'"):
        decode_infer_request(request)


def test_a_broken_request_stream_ends_with_its_error_status_after_the_answers_due(server):
    """A stream whose second message cannot be parsed: the first still gets its answer, then the call
    ends INVALID_ARGUMENT (not OK, which would tell the client everything went through)."""
    good = service_pb2.ModelInferRequest(model_name="add_sub_onnx", id="ok")
    for name in ("INPUT0", "INPUT1"):
        t = good.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        t.contents.fp32_contents.extend([1.0] * 16)
    with grpc.insecure_channel(server.grpc_url) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                     request_serializer=lambda b: b,
                                     response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
        answers = call(iter([good.SerializeToString(), b"\xff\xff\xff"]), timeout=60)
        got = []
        with pytest.raises(grpc.RpcError) as info:
            for a in answers:
                got.append(a)
    assert [(a.error_message, a.infer_response.id) for a in got] == [("", "ok")]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def test_cuda_shared_memory_is_unimplemented_log_and_trace_settings_answer(client, stub):
    assert client.get_system_shared_memory_status().regions == {}
    err = error_of(lambda: client.register_cuda_shared_memory("r0", b"aGFuZGxl", 0, 64))
    assert err.status() == "StatusCode.UNIMPLEMENTED"
    # the trace extension answers (tests/serve/test_trace.py)
    assert list(stub.TraceSetting(service_pb2.TraceSettingRequest(), timeout=60).settings["trace_level"].value) == ["OFF"]
    # the logging extension answers (tests/serve/test_log_settings.py): an empty request reads the settings
    assert set(stub.LogSettings(service_pb2.LogSettingsRequest(), timeout=60).settings) == {
        "log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format"}
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    assert client.get_cuda_shared_memory_status().regions == {}


def test_compressed_request(client):
    x = np.full((1, 16), 3, np.float32)
    result = client.infer("add_sub_onnx", add_sub_inputs(x, x), compression_algorithm="gzip")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * x)


def test_large_messages_cross_flow_control_windows(client):
    """Megabytes each way: split into frames and paced by HTTP/2 flow control."""
    big = np.array([[bytes(range(97, 123)) * 120_000, b"x" * 70_000]], dtype=np.object_)  # ~3 MB
    i = grpcclient.InferInput("TEXT", [1, 2], "BYTES")
    i.set_data_from_numpy(big)
    result = client.infer("string_py", [i])
    upper = result.as_numpy("UPPER").reshape(-1)
    assert upper[0] == big[0, 0].upper() and upper[1] == b"X" * 70_000
    assert result.as_numpy("LENGTH").tolist() == [[len(big[0, 0]), 70_000]]


def test_a_huge_error_message_is_cut_not_a_broken_connection(stub):
    """The status of a request naming a 50 kB model: the same code as for a short name, the message cut
    to fit the trailers (an over-long trailer block would kill the call with a protocol error)."""
    with pytest.raises(grpc.RpcError) as short:
        stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="nope"), timeout=60)
    with pytest.raises(grpc.RpcError) as long:
        stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="é" * 25_000), timeout=60)
    assert long.value.code() == short.value.code() != grpc.StatusCode.UNKNOWN
    assert long.value.details().startswith(short.value.details().split("'nope'")[0])
    assert len(long.value.details()) < 20_000


def test_h2_model_infer_calls_take_no_task_each(model_repository):
    """On azulite's HTTP/2 transport an unguarded ModelInfer is answered by callback (H2Calls._infer_now,
    TritonDataPlane.infer_then): no Task per call on the server's loop, and the answers, the errors and the
    statistics are the servicer's."""
    x = np.ones((2, 16), np.float32)
    with running_server(model_repository, grpc_impl="h2") as s, grpcclient.InferenceServerClient(s.grpc_url) as c:
        before = c.get_inference_statistics("add_sub_py").model_stats[0].inference_stats
        with tasks_created(s.call) as created:
            for i in range(8):
                result = c.infer("add_sub_py", add_sub_inputs(x * i, x))
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * i + x)
                np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), x * i - x)
            err = error_of(lambda: c.infer("add_sub_py", add_sub_inputs(np.ones((2, 15), np.float32), x)))
            assert err.status() == "StatusCode.INVALID_ARGUMENT" and "INPUT0" in err.message()
            err = error_of(lambda: c.infer("no_such_model", add_sub_inputs(x, x)))
            assert err.status() == "StatusCode.NOT_FOUND" and "no_such_model" in err.message()
            infer_tasks = [name for name in created if "infer" in name.lower() or "unary" in name.lower()]
        assert infer_tasks == []
        after = c.get_inference_statistics("add_sub_py").model_stats[0].inference_stats
        assert after.success.count == before.success.count + 8
        assert after.fail.count == before.fail.count + 1
        counters = (s.server.grpc, s.server.grpc.servicer)  # the statistics call's own count ends after its answer
        assert wait_for(lambda: [k.in_flight for k in counters] == [0, 0]), [k.in_flight for k in counters]


@pytest.mark.parametrize("impl", ["h2", "grpcio"])
def test_canceled_calls_leave_nothing_in_flight(tmp_path, impl):
    """Clients that give up mid-call (RST_STREAM) while their calls are inside the server, two executing
    and two queued behind them: the server counts them out (a drain on shutdown would wait for them
    otherwise) and goes on serving."""
    request = service_pb2.ModelInferRequest(model_name="gate_py")
    t = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
    t.contents.fp32_contents.append(1.0)
    with Gate(tmp_path) as gate, running_server(gate.repository, grpc_impl=impl) as s:
        # the servicer counts its calls; azulite's HTTP/2 transport counts them too (its drain waits on that)
        counters = [s.server.grpc.servicer] + ([s.server.grpc] if impl == "h2" else [])

        def in_flight() -> list[int]:
            return [c.in_flight for c in counters]

        with grpc.insecure_channel(s.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            try:
                calls = [stub.ModelInfer.future(request, timeout=300) for _ in range(4)]
                assert gate.entered(2), "the model never started executing"
                assert wait_for(lambda: in_flight() == [4] * len(counters)), in_flight()
                for call in calls:
                    call.cancel()
                assert wait_for(lambda: in_flight() == [0] * len(counters)), f"still counted: {in_flight()}"
            finally:
                gate.open()  # before the server stops: its drain would wait for the held executions
            assert stub.ModelInfer(request, timeout=60).raw_output_contents
        assert all(call.cancelled() for call in calls)


def wait_for(predicate, timeout: float = 60.0) -> bool:
    """Polls a server counter (a safety-net timeout, not a measurement)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", sid) + payload


def _h2_call(encoder, sid: int, message) -> bytes:
    """HEADERS and DATA(END_STREAM) of one unary ModelInfer call, as raw HTTP/2 frames."""
    headers = encoder.encode([(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                              (":path", "/inference.GRPCInferenceService/ModelInfer"),
                              ("content-type", "application/grpc"), ("te", "trailers")])
    body = message.SerializeToString()
    return _frame(0x1, 0x4, sid, headers) + _frame(0x0, 0x1, sid, b"\0" + struct.pack(">I", len(body)) + body)


def _slow_request():
    request = service_pb2.ModelInferRequest(model_name="slow_py")
    t = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1])
    t.contents.fp32_contents.append(1.0)
    return request


def _frames(data: bytes) -> list[tuple[int, int]]:
    out, pos = [], 0
    while len(data) - pos >= 9:
        n = int.from_bytes(data[pos:pos + 3], "big")
        out.append((data[pos + 3], int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF))
        pos += 9 + n
    return out


class _FrameReader:
    """Reads whole HTTP/2 frames (type, flags, stream id, payload) from a raw socket."""

    def __init__(self, sock) -> None:
        self.sock, self.buf, self.seen = sock, b"", []

    def until(self, predicate) -> list[tuple[int, int, int, bytes]]:
        while True:
            while len(self.buf) >= 9:
                n = int.from_bytes(self.buf[:3], "big")
                if len(self.buf) < 9 + n:
                    break
                frame = (self.buf[3], self.buf[4], int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF,
                         self.buf[9:9 + n])
                self.buf = self.buf[9 + n:]
                self.seen.append(frame)
                if predicate(frame):
                    return self.seen
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"the server closed the connection; frames seen: {self.seen}")
            self.buf += chunk

    def ping(self, payload: bytes) -> None:
        """Round trip: once the ACK is back, the server has read every frame sent before the PING."""
        self.sock.sendall(_frame(0x6, 0, 0, payload))
        self.until(lambda f: f[0] == 0x6 and f[1] & 0x1 and f[3] == payload)


def _frames_with_payload(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, pos = [], 0
    while len(data) - pos >= 9:
        n = int.from_bytes(data[pos:pos + 3], "big")
        out.append((data[pos + 3], data[pos + 4], int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF,
                    data[pos + 9:pos + 9 + n]))
        pos += 9 + n
    return out


def _read_until_closed(sock, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(0x4, 0, 0, b"")


def test_h2_calls_reset_before_they_start_are_counted_out(model_repository):
    """HEADERS, DATA and RST_STREAM of four calls in one packet: each call is canceled before its task
    ever runs, and must still be counted out (azulite's HTTP/2 transport)."""
    encoder = Encoder()
    packet = PREFACE + b"".join(_h2_call(encoder, sid, _slow_request()) + _frame(0x3, 0, sid, struct.pack(">I", 0x8))
                                for sid in (1, 3, 5, 7))
    with running_server(model_repository) as s:
        with socket.create_connection(tuple_of(s.grpc_url), timeout=60) as sock:
            sock.sendall(packet)
            _FrameReader(sock).ping(b"resets!!")  # the server has read the four calls and their resets
            # the canceled tasks are counted out by their done callbacks, a loop turn or two later
            assert wait_for(lambda: s.server.grpc.in_flight == 0, timeout=30), s.server.grpc.in_flight


def test_h2_goaway_then_the_last_reset_closes_the_connection(model_repository):
    """A client that said GOAWAY and then reset its last call: nothing is left, the server hangs up —
    not before the reset (the call was still open) and without an error of its own."""
    encoder = Encoder()
    with running_server(model_repository) as s:
        with socket.create_connection(tuple_of(s.grpc_url), timeout=60) as sock:
            reader = _FrameReader(sock)
            sock.sendall(PREFACE + _h2_call(encoder, 1, _slow_request()) + _frame(0x7, 0, 0, struct.pack(">II", 0, 0)))
            reader.ping(b"stillup?")  # raises if the server hung up with the call still open
            sock.sendall(_frame(0x3, 0, 1, struct.pack(">I", 0x8)))
            frames = reader.seen + _frames_with_payload(_read_until_closed(sock, timeout=30))
    errors = [f for f in frames if f[0] == 0x7 and f[3][4:8] != b"\0\0\0\0"]  # GOAWAY with an error code
    assert not errors, errors
    assert not [f for f in frames if f[2] == 1], frames  # the reset call got no answer


def test_h2_frames_after_a_protocol_error_are_not_served(model_repository):
    """A CONTINUATION out of place is a connection error (GOAWAY); a call in the same packet behind it is
    never answered."""
    ready = service_pb2.ModelInferRequest(model_name="add_sub_onnx")
    packet = PREFACE + _frame(0x9, 0x4, 1, b"") + _h2_call(Encoder(), 3, ready)
    with running_server(model_repository) as s:
        with socket.create_connection(tuple_of(s.grpc_url), timeout=30) as sock:
            sock.sendall(packet)
            frames = _frames(_read_until_closed(sock, timeout=10))
    assert (0x7, 0) in frames and not [f for f in frames if f[1] == 3], frames


def tuple_of(url: str) -> tuple[str, int]:
    host, port = url.split(":")
    return host, int(port)


def test_garbage_on_the_grpc_port_closes_only_that_connection(server, client):
    host, port = server.grpc_url.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64)
        sock.settimeout(30)
        while sock.recv(4096):  # the server answers (GOAWAY or nothing) and closes
            pass
    assert client.is_server_live()


def test_alternating_methods_on_one_channel_each_reach_their_own_handler(stub):
    """The h2 transport keeps each decoded header block's :path with it: on one channel, calls of
    different methods (whose header blocks, once the dynamic table holds them, are a few indexed bytes of
    the same size) must each reach their own method."""
    for _ in range(4):
        meta = stub.ServerMetadata(service_pb2.ServerMetadataRequest())
        assert meta.name and meta.version
        assert stub.ServerLive(service_pb2.ServerLiveRequest()).live is True
        assert stub.ServerReady(service_pb2.ServerReadyRequest()).ready is True
        model = stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="add_sub_onnx"))
        assert model.name == "add_sub_onnx"


def test_a_compressed_message_is_held_to_the_limit_once_inflated(stub, client):
    """80 MiB of zeros gzip to ~80 KiB: the server's 64 MiB message limit holds for what the message inflates
    to (it was inflated whole, with no limit), and the server goes on serving."""
    request = service_pb2.ModelInferRequest(model_name="add_sub_onnx", raw_input_contents=[bytes(80 << 20)])
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=120, compression=grpc.Compression.Gzip)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    x = np.ones((1, 16), np.float32)
    np.testing.assert_array_equal(client.infer("add_sub_onnx", add_sub_inputs(x, x)).as_numpy("OUTPUT0"), 2 * x)
