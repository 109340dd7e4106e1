"""Structure-aware fuzzing of the infer endpoints: valid JSON, binary-tensor and protobuf requests,
mutated field by field (types, shapes, datatypes, lengths, names, nesting) and byte by byte, sent over
HTTP and gRPC. Every answer must be a client error or a success, never a 5xx / INTERNAL / UNKNOWN, and the
server must stay up. ``make test`` runs a few hundred cases; ``make soak`` (AZULITE_SOAK=1) 10,000.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import random

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from .conftest import build_model_repository
from .frontends import running_server

MODELS = ("add_sub_onnx", "string_py", "versioned_py")
BAD_GRPC = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = build_model_repository(tmp_path_factory.mktemp("fuzz_repo"), MODELS)
    with running_server(repo) as s:
        yield s


def json_seeds() -> list[tuple[str, dict]]:
    x = np.arange(16, dtype=np.float32).tolist()
    return [
        ("add_sub_onnx", {"id": "1", "inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": x},
                                                {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "data": x}],
                          "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 2}}]}),
        ("string_py", {"inputs": [{"name": "TEXT", "shape": [1, 2], "datatype": "BYTES", "data": ["ab", "cd"]}]}),
        ("versioned_py", {"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
                          "parameters": {"priority": 0, "timeout": 0}}),
    ]


WEIRD = [None, True, -1, 0, 2**63, -(2**63) - 1, 1e308, "", "x" * 300, "FP32", "BYTES", [], [[]], {}, [1, -1],
         [2**40, 2**40], {"a": {"b": []}}, "\u0000\ud7ff", 3.5, [None], ["a", 1, None]]


def mutate_json(rng: random.Random, doc):
    """One random structural change somewhere in the document (returns the new document)."""
    doc = copy.deepcopy(doc)
    paths = []

    def walk(node, path):
        paths.append(path)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node[:8]):
                walk(v, path + [i])

    walk(doc, [])
    path = rng.choice(paths)
    if not path:
        return rng.choice(WEIRD + [[doc], {"inputs": doc}])
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    action = rng.random()
    if action < 0.5:
        parent[key] = rng.choice(WEIRD)
    elif action < 0.65 and isinstance(parent, dict):
        del parent[key]
    elif action < 0.8 and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[key]))
    elif isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
        parent[key] = parent[key] * rng.choice([-1, 0, 1000, 2**31]) + rng.choice([0, 1, -1])
    elif isinstance(parent[key], str):
        parent[key] = parent[key][: rng.randrange(len(parent[key]) + 1)] + rng.choice(["", "\x00", "é", "INPUT0"])
    else:
        parent[key] = rng.choice(WEIRD)
    return doc


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if not data:
            break
        op, pos = rng.random(), rng.randrange(len(data))
        if op < 0.4:
            data[pos] = rng.randrange(256)
        elif op < 0.6:
            del data[pos:pos + rng.randint(1, 16)]
        elif op < 0.8:
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            data = data[:pos]
    return bytes(data)


def binary_request(rng: random.Random) -> tuple[bytes, dict]:
    """add_sub_onnx with its inputs in the binary tensor extension, then a mutation of the header, the
    declared sizes or the binary part."""
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    header = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 64}}
                         for n in ("INPUT0", "INPUT1")],
              "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}
    if rng.random() < 0.5:
        header = mutate_json(rng, header)
    head = json.dumps(header).encode()
    blob = a.tobytes() * 2
    hlen = len(head)
    choice = rng.random()
    if choice < 0.25:
        hlen = rng.choice([-1, 0, hlen + 1, hlen - 1, len(head) + len(blob) + 10, 2**63])
    elif choice < 0.5:
        blob = mutate_bytes(rng, blob)
    return head + blob, {"Inference-Header-Content-Length": str(hlen), "Content-Type": "application/octet-stream"}


def grpc_request(rng: random.Random) -> bytes:
    request = pb.ModelInferRequest(model_name=rng.choice(MODELS + ("nope", "")), id="f")
    for name in ("INPUT0", "INPUT1"):
        t = request.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        request.raw_input_contents.append(np.ones(16, dtype=np.float32).tobytes())
        if rng.random() < 0.3:
            t.shape[:] = [rng.choice([-1, 0, 1, 16, 2**40, -(2**40)]) for _ in range(rng.randint(0, 4))]
        if rng.random() < 0.2:
            t.datatype = rng.choice(["", "BYTES", "FP16", "BF16", "BOOL", "INT8", "x"])
        if rng.random() < 0.15:
            t.contents.fp32_contents.extend([1.0] * rng.randint(0, 20))
        if rng.random() < 0.1:
            t.parameters["binary_data_size"].int64_param = rng.choice([-1, 2**62])
    if rng.random() < 0.3:
        request.raw_input_contents[rng.randrange(2)] = bytes(rng.randrange(256) for _ in range(rng.randint(0, 70)))
    if rng.random() < 0.2:
        del request.raw_input_contents[:]
    if rng.random() < 0.2:
        request.outputs.add(name=rng.choice(["OUTPUT0", "X", ""])).parameters["classification"].int64_param = \
            rng.choice([-1, 0, 3, 2**40])
    if rng.random() < 0.2:
        request.parameters[rng.choice(["priority", "timeout", "sequence_id"])].string_param = "x"
    data = request.SerializeToString()
    return mutate_bytes(rng, data) if rng.random() < 0.4 else data


class HttpSender:
    def __init__(self, url: str) -> None:
        self.host, port = url.split(":")
        self.port = int(port)
        self.conn = None

    def post(self, path: str, body: bytes, headers: dict) -> int:
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
            try:
                self.conn.request("POST", path, body=body, headers=headers)
                resp = self.conn.getresponse()
                resp.read()
                if resp.getheader("Connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = None
                return resp.status
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


def fuzz(server, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    sender = HttpSender(server.http_url)
    channel = grpc.insecure_channel(server.grpc_url)
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    seeds = json_seeds()
    counts: dict = {}
    try:
        for i in range(n):
            kind = i % 3
            if kind == 0:
                model, doc = rng.choice(seeds)
                for _ in range(rng.randint(1, 3)):
                    doc = mutate_json(rng, doc)
                body = json.dumps(doc).encode()
                if rng.random() < 0.2:
                    body = mutate_bytes(rng, body)
                status = sender.post(f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"})
                assert status < 500, (i, "json", body[:300], status)
            elif kind == 1:
                body, headers = binary_request(rng)
                status = sender.post("/v2/models/add_sub_onnx/infer", body, headers)
                assert status < 500, (i, "binary", body[:300], headers, status)
            else:
                message = grpc_request(rng)
                try:
                    infer(message, timeout=120)
                    status = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    status = exc.code()
                    assert status not in BAD_GRPC, (i, "grpc", message[:300], status, exc.details())
            counts[(kind, str(status))] = counts.get((kind, str(status)), 0) + 1
    finally:
        channel.close()
        if sender.conn is not None:
            sender.conn.close()
    live = http.client.HTTPConnection(*server.http_url.split(":"), timeout=60)
    live.request("GET", "/v2/health/live")
    assert live.getresponse().status == 200
    live.close()
    return counts


def test_fuzzed_requests_never_get_a_5xx(server):
    counts = fuzz(server, 300, seed=11)
    assert sum(counts.values()) == 300
    assert any(k[1] in ("200", "StatusCode.OK") for k in counts)  # some mutations stay valid
    assert any(k[1] == "400" for k in counts) and any("INVALID_ARGUMENT" in k[1] for k in counts)


@pytest.mark.soak
def test_fuzzed_requests_soak(server):
    n = 10_000 if os.environ.get("AZULITE_SOAK") == "1" else 1000
    counts = fuzz(server, n, seed=20261123)
    assert sum(counts.values()) == n
