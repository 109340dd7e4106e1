"""What the guard costs a request (issue 11's goal: guarded/off >= 0.95x throughput), measured as server
CPU time per request — the server process's user+system CPU seconds (all its threads: event loop, model
instance, audit writer) over the requests it answered — which moves less than throughput with what else
the machine runs. It still moves with the batch size dynamic batching reached (fewer requests per model
execution: more CPU per request), so requests per execution are reported beside it, with throughput
and p99.

Servers (azulite serve, the bench_matmul model of bench/serving.py): ``off``; ``guarded``: --auth with a
key that has a per-key rate limit and quota, a per-model rate limit (figures set high: checked on every
request, never refusing) and the audit log. perf_analyzer sends ``-H`` headers over HTTP only, so over
gRPC the guarded server runs the limits and audit log without a key (as bench/serving.py); over HTTP
both servers get the very same requests, key header included. Each round measures off and guarded on
each protocol, in turn (the order flips every round); the medians over the rounds are reported, with
the main thread's CPU per request apart (the event loop: where the guard's check and the audit's record
run), and the audit log's writer process (serve/audit_writer.py: it formats and writes the lines beside
the server, on another core) apart too: ``cpu_per_request`` is the server process's (what bounds a
CPU-bound server's throughput, and ``goal_met``), ``cpu_per_request_with_writer`` adds the writer's.

    .venv/bin/python bench/guard_overhead.py [--anchors DIR] [--rounds 3] [--concurrency 32] [--measure-ms 3000]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import MODEL, anchors, build_model_repository, free_port, perf, start_server, stop  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children_cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process's live children: the audit log's writer process
    (serve/audit_writer.py), which formats and writes the lines on a core of its own."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def main_thread_cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process's main thread alone: the event loop, where the guard's
    check and the audit's record run (the audit writer is another thread)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def answered(metrics_port: int) -> tuple[int, int]:
    """(inference requests the server counted — success and failure: refusals cost CPU too —, model
    executions): requests per execution is the batch size, which moves CPU per request by itself."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    out = []
    for names in (("nv_inference_request_success", "nv_inference_request_failure"), ("nv_inference_exec_count",)):
        total = 0
        for name in names:
            for m in re.finditer(rf"^{name}{{[^}}]*model=\"{MODEL}\"[^}}]*}} ([0-9.e+]+)$", text, re.M):
                total += int(float(m.group(1)))
        out.append(total)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--anchors", help="folder holding bin/perf_analyzer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--measure-ms", type=int, default=3000)
    args = ap.parse_args()
    pa = anchors(args.anchors) / "perf_analyzer"
    work = Path(tempfile.mkdtemp(prefix="azulite-bench-guard-"))
    servers: dict[str, tuple] = {}
    try:
        repo = build_model_repository(work / "repo", (MODEL,))
        data = work / "input.json"
        data.write_text(json.dumps({"data": [{"x": {"content": [0.5] * 256, "shape": [256]}}]}))
        from azulite.serve.keystore import KeyStore

        store = KeyStore(work / "keys.db")
        _, token = store.create("bench", rps=1e9, quota_per_day=10**12)
        store.close()
        azulite = [str(Path(sys.executable).parent / "azulite"), "serve", str(repo), "--http-address", "127.0.0.1",
                   "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1"]
        guard = ["--model-rate-limit", f"{MODEL}=1e9", "--audit-log", str(work / "audit.jsonl"),
                 "--audit-log-max-bytes", str(16 * 1024 * 1024)]
        for name, extra in (("off", []), ("guarded_http", guard + ["--auth", "--key-store", str(work / "keys.db")]),
                            ("guarded_grpc", guard)):
            h, g, m = free_port(), free_port(), free_port()
            cmd = azulite + ["--http-port", str(h), "--grpc-port", str(g), "--metrics-port", str(m), *extra]
            servers[name] = (start_server(name, cmd, h, work), h, g, m)
        rows: dict[str, list[dict]] = {}
        for round_no in range(args.rounds):
            for protocol in ("http", "grpc"):
                pair = ("off", f"guarded_{protocol}")
                for name in pair if round_no % 2 == 0 else pair[::-1]:
                    proc, h, g, m = servers[name]
                    # over HTTP both get the very same requests, key header included (ignored when off), as
                    # bench/serving.py sends them: the difference is the server's guard, not larger requests
                    headers = (f"Authorization:Bearer {token}",) if protocol == "http" else ()
                    t0, c0, w0, (n0, e0) = (main_thread_cpu_s(proc.pid), cpu_s(proc.pid), children_cpu_s(proc.pid),
                                            answered(m))
                    r = perf(pa, protocol, h if protocol == "http" else g, args.concurrency, data, args.measure_ms,
                             work, headers)
                    t1, c1, w1, (n1, e1) = (main_thread_cpu_s(proc.pid), cpu_s(proc.pid), children_cpu_s(proc.pid),
                                            answered(m))
                    if "error" in r or n1 <= n0 or e1 <= e0:
                        print(f"  {name} {protocol}: {r.get('error', 'no requests counted')}", flush=True)
                        continue
                    r["cpu_us_per_request"] = round((c1 - c0) / (n1 - n0) * 1e6, 1)
                    r["main_thread_cpu_us_per_request"] = round((t1 - t0) / (n1 - n0) * 1e6, 1)
                    r["writer_cpu_us_per_request"] = round((w1 - w0) / (n1 - n0) * 1e6, 1)
                    r["requests_per_execution"] = round((n1 - n0) / (e1 - e0), 2)
                    r["load_avg_1m"] = round(os.getloadavg()[0], 2)
                    key = f"{'off' if name == 'off' else 'guarded'}_{protocol}"
                    rows.setdefault(key, []).append(r)
                    print(f"  {key:13s} {r['infer_per_s']:>9.1f} infer/s  p99 {r['p99_ms']:7.3f} ms  "
                          f"{r['cpu_us_per_request']:7.1f} CPU-us/request (main thread "
                          f"{r['main_thread_cpu_us_per_request']:.1f}, + writer process "
                          f"{r['writer_cpu_us_per_request']:.1f})  batch {r['requests_per_execution']:5.2f}  "
                          f"load {r['load_avg_1m']}", flush=True)
    finally:
        for proc, *_ in servers.values():
            stop(proc)
        shutil.rmtree(work, ignore_errors=True)
    out: dict = {"bench": "guard_overhead", "model": MODEL, "concurrency": args.concurrency, "rounds": args.rounds}
    for key, rs in rows.items():
        out[key] = {f: statistics.median(r[f] for r in rs)
                    for f in ("infer_per_s", "p99_ms", "cpu_us_per_request", "main_thread_cpu_us_per_request",
                              "writer_cpu_us_per_request", "requests_per_execution")}
        out[key]["load_avg_1m"] = [r["load_avg_1m"] for r in rs]
    for protocol in ("http", "grpc"):
        off, on = out.get(f"off_{protocol}"), out.get(f"guarded_{protocol}")
        if off and on:
            main_on, main_off = on["main_thread_cpu_us_per_request"], off["main_thread_cpu_us_per_request"]
            tree_on = on["cpu_us_per_request"] + on["writer_cpu_us_per_request"]
            tree_off = off["cpu_us_per_request"] + off["writer_cpu_us_per_request"]
            out[f"ratio_{protocol}"] = {"throughput": round(on["infer_per_s"] / off["infer_per_s"], 3),
                                        "cpu_per_request": round(on["cpu_us_per_request"] / off["cpu_us_per_request"], 3),
                                        "main_thread_cpu_per_request": round(main_on / main_off, 3),
                                        "cpu_per_request_with_writer": round(tree_on / tree_off, 3)}
            # the throughput a CPU-bound server would reach: off's CPU per request over guarded's (the server
            # process, whose one event loop bounds it; the audit writer process runs beside it on another core)
            out[f"goal_met_{protocol}"] = off["cpu_us_per_request"] / on["cpu_us_per_request"] >= 0.95
    print(json.dumps(out))


if __name__ == "__main__":
    main()
