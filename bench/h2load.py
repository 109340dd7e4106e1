"""h2load (nghttp2's load generator, C) as the load generator of a serving point, where it fits: one fixed
request, sent over and over, to KServe v2 HTTP (the binary tensor extension both ways, as perf_analyzer uses it)
or to gRPC ``ModelInfer`` (the request's protobuf in one gRPC frame over h2). It costs the machine less
CPU per request than perf_analyzer, which on 2 cores is CPU the servers get back; it checks nothing of an
answer beyond its HTTP status (a gRPC error comes with status 200), so a run also reads the server's own
count of successful inferences (the caller's job: bench/serving_workers.py does) and ``failed`` says
what h2load saw fail.

Concurrency C: over HTTP/1.1, C connections with one request each in flight; over gRPC, min(C, 8)
connections (a server with ``--workers N`` spreads connections, not streams) with C / connections
streams each. Latency percentiles come from h2load's per-request log (``--log-file``).
"""

from __future__ import annotations

import json
import struct
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: the gRPC method's path on the wire
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"


@dataclass(frozen=True, slots=True)
class Body:
    """One request as h2load sends it: the body's file and the headers that go with it."""

    path: Path
    headers: tuple[str, ...]


def bodies(work: Path, model: str, inputs: dict[str, np.ndarray], *, binary_outputs: bool = True,
           json_inputs: bool = False) -> dict[str, Body]:
    """One request for ``model`` per protocol, written under ``work``: {"http": ..., "grpc": ...}.
    ``inputs`` hold the batch dimension (shape [1, ...] for one row). For a client without the binary
    extension (curl, most REST clients), over HTTP: ``binary_outputs=False`` asks for the outputs as JSON
    numbers, ``json_inputs=True`` sends the inputs as JSON numbers."""
    from tritonclient.grpc import service_pb2  # the field names as Triton's schema defines them

    from azulite.serve.config import numpy_to_wire

    # by default outputs in binary too, as perf_analyzer asks for them (JSON numbers cost a server more to write)
    header = {"inputs": [{"name": name, "shape": list(a.shape), "datatype": numpy_to_wire(a.dtype),
                          **({"data": a.reshape(-1).tolist()} if json_inputs else
                             {"parameters": {"binary_data_size": a.nbytes}})} for name, a in inputs.items()],
              **({"parameters": {"binary_data_output": True}} if binary_outputs else {})}
    head = json.dumps(header).encode()
    http = work / f"{model}.{'json-in.' if json_inputs else ''}{'' if binary_outputs else 'json-out.'}http-body"
    http.write_bytes(head if json_inputs else head + b"".join(a.tobytes() for a in inputs.values()))
    req = service_pb2.ModelInferRequest(model_name=model, raw_input_contents=[a.tobytes() for a in inputs.values()])
    for name, a in inputs.items():
        req.inputs.add(name=name, datatype=numpy_to_wire(a.dtype), shape=list(a.shape))
    msg = req.SerializeToString()
    grpc = work / f"{model}.grpc-body"
    grpc.write_bytes(b"\0" + struct.pack(">I", len(msg)) + msg)  # uncompressed, length-prefixed
    return {"http": Body(http, ("content-type: application/json",) if json_inputs else
                         ("content-type: application/octet-stream", f"inference-header-content-length: {len(head)}")),
            "grpc": Body(grpc, ("content-type: application/grpc", "te: trailers"))}


def command(model: str, protocol: str, port: int, concurrency: int, body: Body, *, duration_s: float | None = None,
            requests: int | None = None, warm_up_s: float = 0.0, log: Path) -> list[str]:
    """h2load's command line for one point: ``duration_s`` (measured after ``warm_up_s``) or ``requests``."""
    if protocol == "http":
        cmd = ["h2load", "--h1", "-c", str(concurrency), "-m", "1", f"http://127.0.0.1:{port}/v2/models/{model}/infer"]
    else:
        conns = max(1, min(concurrency, 8))
        cmd = ["h2load", "-c", str(conns), "-m", str(max(1, concurrency // conns)), f"http://127.0.0.1:{port}{GRPC_INFER}"]
    for h in body.headers:
        cmd += ["-H", h]
    cmd += ["-d", str(body.path), "--log-file", str(log)]
    if requests is not None:
        cmd += ["-n", str(requests)]
    else:
        # h2load takes whole seconds or a unit: milliseconds
        cmd += ["-D", f"{round(duration_s * 1000)}ms"]
        if warm_up_s:
            cmd += ["--warm-up-time", f"{round(warm_up_s * 1000)}ms"]
    return cmd


def run(model: str, protocol: str, port: int, concurrency: int, body: Body, work: Path, *,
        duration_s: float | None = None, requests: int | None = None, warm_up_s: float = 0.0,
        prefix: Sequence[str] = (), timeout_s: float = 600) -> dict:
    """One h2load point: ``infer_per_s`` (requests done / measured seconds, h2load's figure), ``p50_ms`` and
    ``p99_ms`` (its log), ``done`` and ``failed`` (not a 2xx, or no answer); ``error`` instead when it did
    not run."""
    log = work / f"h2load-{model}-{protocol}-{concurrency}.log"
    log.unlink(missing_ok=True)
    cmd = [*prefix, *command(model, protocol, port, concurrency, body, duration_s=duration_s, requests=requests,
                             warm_up_s=warm_up_s, log=log)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"h2load did not finish within {timeout_s:.0f} s"}
    return parse(p.stdout, log) if p.returncode == 0 else {"error": (p.stdout + p.stderr)[-400:] or f"exit {p.returncode}"}


def parse(stdout: str, log: Path) -> dict:
    """h2load's summary (``finished in ..., R req/s``; ``requests: ... N done, ... F failed, E errored,
    T timeout``) and its per-request log (start µs, status, latency µs; tab-separated)."""
    rate = done = bad = None
    for line in stdout.splitlines():
        if line.startswith("finished in"):
            rate = float(line.split(",")[1].split()[0])
        elif line.startswith("requests:"):
            counts = {k: int(v) for v, k in (part.split()[:2] for part in line.split(":", 1)[1].split(","))}
            done = counts["done"]
            bad = counts["failed"] + counts["errored"] + counts.get("timeout", 0)
    if rate is None or done is None:
        return {"error": "h2load printed no summary: " + stdout[-400:]}
    lat_us = [int(f[2]) for f in (line.split("\t") for line in log.read_text().splitlines()) if len(f) == 3 and f[1] == "200"]
    if not lat_us:
        return {"error": f"h2load logged no answered request ({done} done, {bad} failed)"}
    lat = np.array(lat_us) / 1000
    return {"infer_per_s": round(rate, 1), "p50_ms": round(float(np.percentile(lat, 50)), 3),
            "p99_ms": round(float(np.percentile(lat, 99)), 3), "stable": True, "done": done, "failed": bad}
