"""A raw HTTP/2 gRPC client for tests that need what grpcio does not let a test choose: several calls in one
write (so they reach the server in one read), and the server's own answer to a deadline (grpcio's client
ends a call at its deadline itself, whatever the server answers)."""

from __future__ import annotations

import socket
import struct

import h2.config
import h2.connection
import h2.events
import numpy as np

from azulite.serve.proto import service_pb2 as pb

PATH = "/inference.GRPCInferenceService/ModelInfer"


def burst(port: int, model: str, calls: list[tuple[int, list[float]]], headers: tuple = ()
          ) -> dict[int, tuple[int, str, dict]]:
    """Every ModelInfer call (id, X's rows: FP32 [n, 1]) on one HTTP/2 connection in ONE write, each with the
    extra ``headers`` (e.g. grpc-timeout); per id: (grpc-status, message, outputs by name)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    sids = {}
    for rid, xs in calls:
        request = pb.ModelInferRequest(model_name=model, id=str(rid))
        request.inputs.add(name="X", datatype="FP32", shape=[len(xs), 1])
        request.raw_input_contents.append(np.array(xs, np.float32).tobytes())
        body = request.SerializeToString()
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "x"),
                                ("content-type", "application/grpc"), ("te", "trailers"), *headers])
        conn.send_data(sid, struct.pack(">BL", 0, len(body)) + body, end_stream=True)
        sids[sid] = rid
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    data: dict[int, bytes] = {sid: b"" for sid in sids}
    done: dict[int, tuple[int, str, dict]] = {}
    try:
        s.sendall(conn.data_to_send())
        while len(done) < len(sids):
            chunk = s.recv(1 << 16)
            assert chunk, "the server closed the connection"
            for e in conn.receive_data(chunk):
                if isinstance(e, h2.events.DataReceived):
                    data[e.stream_id] += e.data
                    conn.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
                elif isinstance(e, (h2.events.TrailersReceived, h2.events.ResponseReceived)):
                    got = dict(e.headers)
                    if "grpc-status" in got:
                        outputs = {}
                        if data[e.stream_id]:
                            reply = pb.ModelInferResponse.FromString(data[e.stream_id][5:])
                            assert reply.id == str(sids[e.stream_id])
                            for out, raw in zip(reply.outputs, reply.raw_output_contents):
                                dtype = np.float32 if out.datatype == "FP32" else np.int64
                                outputs[out.name] = np.frombuffer(raw, dtype).reshape(tuple(out.shape))
                        done[sids[e.stream_id]] = (int(got["grpc-status"]), got.get("grpc-message", ""),
                                                   outputs)
            s.sendall(conn.data_to_send())
    finally:
        s.close()
    return done
