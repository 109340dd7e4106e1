"""What the guard costs a request (issue 11's goal: guarded/off >= 0.95x throughput at c=32), on its own:
guarded and off interleaved over several rounds on fresh servers (bench/guard_rounds.py says how), each
round's throughput, p99 and server CPU per request (process, event-loop thread, audit writer process
apart) printed, and the medians of the per-round ratios. bench/serving.py runs the same rounds for its
guard part beside Triton.

    .venv/bin/python bench/guard_overhead.py [--anchors DIR] [--rounds 5] [--concurrency 32] [--measure-ms 3000]
        [--protocol http grpc] [--modes all auth limit audit]

``--modes``: the guard's parts measured apart, each against its own off side ("all": key + limits + quota
+ audit log, the goal's guard; "auth": the key alone, with its rate and quota; "limit": the model's rate
limit alone; "audit": the audit log alone). Last line: one JSON object (per mode, ``http`` / ``grpc``:
``rounds``, ``median_ratio``, ``goal_met``, ...; with one mode, at the top level as before).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from guard_rounds import PARTS, QUOTA, RATE, azulite_serve, measure  # noqa: E402
from serving import MODEL, anchors, build_model_repository  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--anchors", help="folder holding bin/perf_analyzer")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--measure-ms", type=int, default=3000)
    ap.add_argument("--protocol", nargs="+", choices=("http", "grpc"), default=["http", "grpc"])
    ap.add_argument("--modes", nargs="+", choices=tuple(PARTS), default=["all"])
    args = ap.parse_args()
    pa = anchors(args.anchors) / "perf_analyzer"
    work = Path(tempfile.mkdtemp(prefix="azulite-bench-guard-"))
    try:
        repo = build_model_repository(work / "repo", (MODEL,))
        data = work / "input.json"
        data.write_text(json.dumps({"data": [{"x": {"content": [0.5] * 256, "shape": [256]}}]}))
        from azulite.serve.keystore import KeyStore

        store = KeyStore(work / "keys.db")
        _, token = store.create("bench", rps=RATE, quota_per_day=QUOTA)
        store.close()
        by_mode = {}
        for mode in args.modes:
            print(f"mode {mode}: guarded = {'+'.join(PARTS[mode])}", flush=True)
            protocols = [p for p in args.protocol if p == "http" or mode != "auth"]  # no key over gRPC
            by_mode[mode] = measure(pa, azulite_serve(repo), token, work / "keys.db", data, work, rounds=args.rounds,
                                    concurrency=args.concurrency, measure_ms=args.measure_ms, protocols=protocols,
                                    log=lambda line: print(line, flush=True), parts=PARTS[mode])
        figures = by_mode[args.modes[0]] if len(args.modes) == 1 else {"modes": by_mode}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"bench": "guard_overhead", "model": MODEL, "load_avg_1m_end": round(os.getloadavg()[0], 2),
                      **figures}))


if __name__ == "__main__":
    main()
