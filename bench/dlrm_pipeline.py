"""The DLRM served pipeline, one step against two: ``azulite export --pipeline fused`` (one Python-backend
model parsing the raw Criteo rows and running model.onnx in one execute) against ``--pipeline ensemble``
(``dlrm_preprocess`` -> ``dlrm_model`` chained by an ensemble), both served by ``azulite serve`` from the
same checkpoint, driven by perf_analyzer at the points that decide it (32-row requests at c=32 over HTTP and
gRPC, 1-row requests at c=32 over HTTP).

What decides is the server's CPU per row (its process tree's, from /proc, over the rows its statistics
count): a figure the machine's load stretches far less than throughput. The two servers run side by side
and are measured in alternating order (A B, then B A, ...) so a change in the load hits both alike; per
point the medians over the rounds, and ``fused_over_ensemble`` (below 1: the one-step form costs less).
The last line printed is one JSON object.

    python bench/dlrm_pipeline.py [--anchors DIR] [--rounds 4] [--measure-ms 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import serve_models as sm  # noqa: E402 - the DLRM build and perf_analyzer runs of bench/serve_models.py
import serving as base  # noqa: E402 - ports, server start/stop
from server_procs import tree_cpu_s  # noqa: E402
from serving_workers import inference_count  # noqa: E402

VARIANTS = ("fused", "ensemble")
#: (protocol, concurrency, rows per request)
POINTS = (("http", 32, 32), ("grpc", 32, 32), ("http", 32, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--anchors", help="folder holding bin/perf_analyzer")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--measure-ms", type=int, default=2000)
    args = ap.parse_args()
    bin_dir = base.anchors(args.anchors)
    work = Path(tempfile.mkdtemp(prefix="azulite-bench-dlrm-pipeline-"))
    servers: dict = {}
    base.MODEL = "dlrm"
    try:
        models = {v: sm.build_dlrm(work / v, v) for v in VARIANTS}
        for v, bm in models.items():
            http_port, grpc_port, metrics_port = base.free_port(), base.free_port(), base.free_port()
            cmd = base.server_cmd("azulite", bin_dir, bm.repo, http_port, grpc_port, metrics_port)
            servers[v] = (base.start_server(f"dlrm-{v}", cmd, http_port, work), http_port, grpc_port)
        rounds: list[dict] = []
        for i in range(args.rounds):
            order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
            row: dict = {"round": i, "order": list(order), "load_avg_1m": os.getloadavg()[0]}
            for protocol, c, rows in POINTS:
                key = f"{protocol}_c{c}_rows{rows}"
                row[key] = {}
                for v in order:
                    proc, http_port, grpc_port = servers[v]
                    rows0, cpu0 = inference_count(http_port, "dlrm"), tree_cpu_s(proc.pid)
                    r = sm.perf(bin_dir / "perf_analyzer", models[v], protocol,
                                http_port if protocol == "http" else grpc_port, c, args.measure_ms, work, rows)
                    served = inference_count(http_port, "dlrm") - rows0
                    client = r.pop("client_cpu_s", 0.0)
                    if "error" not in r and served > 0:
                        r["server_cpu_us_per_row"] = round((tree_cpu_s(proc.pid) - cpu0) / served * 1e6, 2)
                        r["client_cpu_us_per_row"] = round(client / served * 1e6, 2)
                    row[key][v] = r
                    print(f"round {i} {key:18s} {v:8s} "
                          + (f"{r['infer_per_s']:>9.1f} rows/s  p99 {r['p99_ms']:7.3f} ms  server CPU "
                             f"{r.get('server_cpu_us_per_row', float('nan')):6.2f} us/row" if "error" not in r
                             else f"error: {r['error']}"), flush=True)
            rounds.append(row)
        summary: dict = {}
        for protocol, c, rows in POINTS:
            key = f"{protocol}_c{c}_rows{rows}"
            per: dict = {}
            for v in VARIANTS:
                ok = [r[key][v] for r in rounds if "server_cpu_us_per_row" in r[key][v]]
                per[v] = {"server_cpu_us_per_row": round(statistics.median(x["server_cpu_us_per_row"] for x in ok), 2),
                          "infer_per_s": round(statistics.median(x["infer_per_s"] for x in ok), 1),
                          "p99_ms": round(statistics.median(x["p99_ms"] for x in ok), 3)} if ok else {}
            if per["fused"] and per["ensemble"]:
                per["fused_over_ensemble"] = {
                    k: round(per["fused"][k] / per["ensemble"][k], 3) for k in ("server_cpu_us_per_row", "infer_per_s", "p99_ms")}
            summary[key] = per
        print(json.dumps({"bench": "dlrm_pipeline", "rounds": rounds, "median": summary}))
    finally:
        for proc, _, _ in servers.values():
            base.stop(proc)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
