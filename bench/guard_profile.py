"""Where the guard's time goes on the event loop, per request: the same HTTP inference requests sent to an
in-process server without and with the guard (``--auth`` key with limits, a model limit, the audit log, as
bench/guard_rounds.py's guarded side), cProfile on the loop thread only, and the diff of the two
profiles printed per request — every Python function whose calls or own time differ, with its calls per
request and µs per request (profiled µs: cProfile's own cost inflates them, the ranking is what counts).
The CPU figures that decide the goal come from bench/guard_overhead.py; this says what to fold.

    .venv/bin/python bench/guard_profile.py [--requests 4000] [--clients 8] [--top 40]

Last line: one JSON object (``calls_per_request`` and ``us_per_request`` per side, the guard's extra
functions).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import http.client
import json
import os
import pstats
import shutil
import struct
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from guard_rounds import QUOTA, RATE  # noqa: E402
from serving import MODEL, build_model_repository  # noqa: E402


def run_side(repo: Path, guard, requests: int, clients: int, headers: dict[str, str], body: bytes) -> pstats.Stats:
    from azulite.serve.server import Server, ServerSettings, new_event_loop

    settings = ServerSettings(repository=repo, http_address="127.0.0.1", http_port=0, grpc_port=-1,
                              metrics_address="127.0.0.1", metrics_port=0, guard=guard)
    server = Server(settings)
    loop = new_event_loop()
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    if not started.wait(180):
        raise TimeoutError("server did not start")
    port = server.ports["http"]
    path = f"/v2/models/{MODEL}/infer"

    def client(n: int, errors: list) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for _ in range(n):
            conn.request("POST", path, body, headers)
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                errors.append(r.status)
        conn.close()

    errors: list = []
    client(50, errors)  # warm: plans, routes, audit ids
    prof = cProfile.Profile()
    asyncio.run_coroutine_threadsafe(_call(prof.enable), loop).result(30)
    threads = [threading.Thread(target=client, args=(requests // clients, errors)) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    asyncio.run_coroutine_threadsafe(_call(prof.disable), loop).result(30)
    asyncio.run_coroutine_threadsafe(server.stop(10), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(60)
    loop.close()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[:5]}")
    return pstats.Stats(prof)


async def _call(fn) -> None:
    fn()


def per_function(stats: pstats.Stats, n: int) -> dict[str, tuple[float, float]]:
    """function -> (calls per request, own µs per request)."""
    out = {}
    for (file, line, name), (_cc, calls, tottime, _ct, _callers) in stats.stats.items():
        where = f"{Path(file).name}:{line}({name})" if file != "~" else name
        out[where] = (calls / n, tottime / n * 1e6)
    return out


def diff(off: dict[str, tuple[float, float]], on: dict[str, tuple[float, float]], min_calls: float = 0.05,
         min_us: float = 0.3) -> list[tuple[float, float, float, float, str]]:
    """(extra µs, extra calls, calls off, calls guarded, function) per request for every function whose
    calls or own time differ by at least ``min_calls`` / ``min_us`` between the sides, most extra time
    first (a function on one side only counts as 0 calls and 0 µs on the other)."""
    rows = []
    for fn in set(off) | set(on):
        c0, t0 = off.get(fn, (0.0, 0.0))
        c1, t1 = on.get(fn, (0.0, 0.0))
        if abs(c1 - c0) >= min_calls or abs(t1 - t0) >= min_us:
            rows.append((t1 - t0, c1 - c0, c0, c1, fn))
    rows.sort(reverse=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    from azulite.serve.auth import GuardSettings
    from azulite.serve.keystore import KeyStore

    work = Path(tempfile.mkdtemp(prefix="azulite-bench-guard-profile-"))
    try:
        repo = build_model_repository(work / "repo", (MODEL,))
        store = KeyStore(work / "keys.db")
        _, token = store.create("bench", rps=RATE, quota_per_day=QUOTA)
        store.close()
        guard = GuardSettings(auth=True, key_store=work / "keys.db", model_rps=((MODEL, RATE),),
                              audit_log=work / "audit.jsonl")
        # binary tensor data, as perf_analyzer sends it (bench/guard_overhead.py measures with it)
        head = json.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                       "parameters": {"binary_data_size": 1024}}],
                           "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
        body = head + struct.pack("<256f", *([0.5] * 256))
        headers = {"Authorization": f"Bearer {token}", "Inference-Header-Content-Length": str(len(head)),
                   "Content-Type": "application/octet-stream"}
        n = args.requests // args.clients * args.clients
        sides = {side: per_function(run_side(repo, g, n, args.clients, headers, body), n)
                 for side, g in (("off", None), ("guarded", guard))}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = diff(sides["off"], sides["guarded"])
    print(f"{'extra µs/req':>12} {'extra calls':>11} {'calls off':>9} {'calls on':>8}  function")
    for dt, dc, c0, c1, fn in rows[:args.top]:
        print(f"{dt:12.2f} {dc:11.2f} {c0:9.2f} {c1:8.2f}  {fn}")
    totals = {side: {"calls_per_request": round(sum(c for c, _ in f.values()), 1),
                     "us_per_request": round(sum(t for _, t in f.values()), 1)} for side, f in sides.items()}
    print(json.dumps({"bench": "guard_profile", "requests": n, "clients": args.clients,
                      "load_avg_1m_end": round(os.getloadavg()[0], 2), **totals,
                      "extra": [{"function": fn, "calls": round(dc, 2), "us": round(dt, 2)}
                                for dt, dc, _, _, fn in rows[:args.top] if dc > 0 or dt > 0]}))


if __name__ == "__main__":
    main()
