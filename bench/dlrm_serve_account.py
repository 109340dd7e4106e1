"""Where a served DLRM request's CPU goes, against the bare loop (issue 10's gap to >= 0.8x the bare session).

The exported one-step DLRM (bench/serve_models.py's ``build_dlrm``: parse + onnxruntime in one Python-backend
execute) is served by ``azulite serve`` in four variants of its model.py, each through perf_analyzer at
concurrency 32 with 32 raw rows per request, the variants' servers started in turn (order alternated per
round, so a change in the machine's load hits them alike):

- ``served``: the model.py as exported;
- ``no_onnx``: the same, its session.run replaced by zeros: the parse and everything around it;
- ``no_model``: no parse and no run either (zeros of the right shapes): what the server itself spends per
  request for a model that does nothing -- HTTP/gRPC, batching, the Python backend's request and response
  objects, the answer;
- ``timed``: as exported, with the thread CPU time of the parse, the run and the whole execute summed
  inside the server (``time.thread_time_ns``, 6 calls a batch, ~1.4 us each here: subtracted).

Per variant: the server's CPU per request (its process, user and system from /proc), the rows each
execution merged (are the batches as large as the bare loop's?), perf_analyzer's CPU per request. Then
the bare loop of bench/serve_models.py (same parse and session, one thread, batches of 64 rows: what
dynamic batching merges from 32 such requests, at most max_batch_size) measured as a whole, parse alone
and run alone. The account per 32-row request:

    served - bare  =  no_model                       (the server's own work)
                   +  (timed parse - bare parse)      (the parse, slower inside the server)
                   +  (timed run - bare run)          (onnxruntime, slower inside the server)
                   +  rest                            (the execute's own lines, the timers' error, noise)

    python bench/dlrm_serve_account.py [--rounds 2] [--protocols http grpc] [--measure-ms 3000]

The last line printed is one JSON object. CPU figures, not throughput: they are what a loaded machine
stretches least (compare medians; the spread is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import serve_models as sm  # noqa: E402 - the exported DLRM and its bare loop
import serving as base  # noqa: E402 - ports, server start/stop
from serving_workers import inference_count  # noqa: E402

ROWS, CONCURRENCY, BATCH = 32, 32, 64
_HZ = os.sysconf("SC_CLK_TCK")
#: a time.thread_time_ns() call here (a system call in this VM): the timed variant's 6 calls a batch
_TIMER_CALLS = 6

#: appended to the exported model.py (which ends with ``TritonPythonModel = ScoringModel``)
VARIANTS = {
    "served": "",
    "no_onnx": '''
class _NoOnnx(ScoringModel):
    def score(self, dense, cats):
        return np.zeros((len(dense), 1), dtype=np.float32)
TritonPythonModel = _NoOnnx
''',
    "no_model": '''
def parse_rows_fast(rows):
    return np.zeros((len(rows), DENSE_COUNT), dtype=np.int64), np.zeros((len(rows), CATEGORY_COUNT), dtype=np.int64)
class _NoModel(ScoringModel):
    def score(self, dense, cats):
        return np.zeros((len(dense), 1), dtype=np.float32)
TritonPythonModel = _NoModel
''',
    "timed": '''
import json as _json, time as _time
_SUMS = {"parse_ns": 0, "run_ns": 0, "execute_ns": 0, "rows": 0, "batches": 0}
_parse_fast = parse_rows_fast
def parse_rows_fast(rows):
    c0 = _time.thread_time_ns()
    out = _parse_fast(rows)
    _SUMS["parse_ns"] += _time.thread_time_ns() - c0
    _SUMS["rows"] += len(rows)
    return out
class _Timed(ScoringModel):
    def score(self, dense, cats):
        c0 = _time.thread_time_ns()
        out = ScoringModel.score(self, dense, cats)
        _SUMS["run_ns"] += _time.thread_time_ns() - c0
        return out
    def execute(self, requests):
        c0 = _time.thread_time_ns()
        out = ScoringModel.execute(self, requests)
        _SUMS["execute_ns"] += _time.thread_time_ns() - c0
        _SUMS["batches"] += 1
        if _SUMS["batches"] % 50 == 1:  # read between points by the bench: a snapshot every 50 batches
            with open(__file__ + ".sums.json", "w") as f:
                _json.dump(_SUMS, f)
        return out
TritonPythonModel = _Timed
''',
}


def process_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of one process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / _HZ, int(fields[12]) / _HZ


def timer_ns() -> float:
    n, t0 = 20000, time.perf_counter_ns()
    for _ in range(n):
        time.thread_time_ns()
    return (time.perf_counter_ns() - t0) / n


def bare_parts(bm_repo: Path, seconds: float) -> dict[str, float]:
    """The bare loop's CPU per 64-row batch, whole and in parts (us per request of 32 rows)."""
    import onnxruntime as ort
    from azulite.export.dlrm import PREPROCESS_MODEL_PY, sample_rows

    namespace: dict = {}
    exec(compile(PREPROCESS_MODEL_PY, "dlrm_preprocess", "exec"), namespace)  # noqa: S102 - the served text
    parse_rows = namespace["parse_rows"]
    rows = sample_rows(256, seed=1).reshape(-1)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(bm_repo / "dlrm" / "1" / "model.onnx"), sess_options=options,
                                   providers=["CPUExecutionProvider"])
    out = {}
    for part in ("warm-up", "whole", "parse", "run"):  # a process's first loop runs slow (1.5x here): not measured
        dense, cats = parse_rows(rows[:BATCH])
        done, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < (0.5 if part == "warm-up" else seconds):
            start = done % (len(rows) - BATCH)
            if part != "run":
                dense, cats = parse_rows(rows[start:start + BATCH])
            if part != "parse":
                session.run(["SCORE"], {"DENSE_RAW": dense, "CATEGORY_IDS": cats})
            done += BATCH
        out[part] = (time.process_time() - c0) / done * ROWS * 1e6
    del out["warm-up"]
    return out


def measure_variant(name: str, repo: Path, bin_dir: Path, protocols: list[str], measure_ms: int, work: Path,
                    data: Path) -> dict:
    http_port, grpc_port, metrics_port = base.free_port(), base.free_port(), base.free_port()
    cmd = base.server_cmd("azulite", bin_dir, repo, http_port, grpc_port, metrics_port)
    proc = base.start_server(f"account-{name}", cmd, http_port, work)
    sums_file = repo / "dlrm" / "1" / "model.py.sums.json"
    bm = sm.BenchModel(repo=repo, model="dlrm", input_data=data, shape_args=["--shape", "ROW:1"],
                       bare=None)  # type: ignore[arg-type] - served only
    out = {}
    try:
        for protocol in protocols:
            port = http_port if protocol == "http" else grpc_port
            sm.perf(bin_dir / "perf_analyzer", bm, protocol, port, CONCURRENCY, 800, work, ROWS)  # warm-up
            rows0, (u0, s0), runs0 = inference_count(http_port, "dlrm"), process_cpu(proc.pid), sm.executions(http_port)
            sums0 = json.loads(sums_file.read_text()) if sums_file.exists() else None
            r = sm.perf(bin_dir / "perf_analyzer", bm, protocol, port, CONCURRENCY, measure_ms, work, ROWS)
            rows = inference_count(http_port, "dlrm") - rows0
            (u1, s1), runs1 = process_cpu(proc.pid), sm.executions(http_port)
            if "error" in r or rows <= 0:
                out[protocol] = {"error": r.get("error", "no rows served")}
                continue
            requests = rows / ROWS
            point = {"rows_per_s": r["infer_per_s"], "stable": r["stable"],
                     "server_user_us_per_request": round((u1 - u0) / requests * 1e6, 1),
                     "server_sys_us_per_request": round((s1 - s0) / requests * 1e6, 1),
                     "client_us_per_request": round(r["client_cpu_s"] / requests * 1e6, 1),
                     "batch_rows": sm.batch_rows(runs0, runs1).get("dlrm")}
            point["server_us_per_request"] = round(point["server_user_us_per_request"]
                                                   + point["server_sys_us_per_request"], 1)
            if sums0 is not None:
                sums1 = json.loads(sums_file.read_text())
                timed_rows = (sums1["rows"] - sums0["rows"]) or 1
                per = ROWS / timed_rows / 1e3  # ns over the timed rows -> us per 32-row request
                timer = TIMER_NS * (sums1["batches"] - sums0["batches"])  # the timers' own cost, all 6 calls
                point["in_server_parse_us"] = round((sums1["parse_ns"] - sums0["parse_ns"]) * per, 1)
                point["in_server_run_us"] = round((sums1["run_ns"] - sums0["run_ns"]) * per, 1)
                point["in_server_execute_us"] = round((sums1["execute_ns"] - sums0["execute_ns"] - timer) * per, 1)
            out[protocol] = point
            print(f"  {name:9s} {protocol:4s} {point['rows_per_s']:>9.0f} rows/s  "
                  f"server {point['server_us_per_request']:6.1f} us/request "
                  f"(sys {point['server_sys_us_per_request']:5.1f})  client {point['client_us_per_request']:6.1f}  "
                  f"rows/execution {point['batch_rows']}"
                  + (f"  in server: parse {point['in_server_parse_us']} run {point['in_server_run_us']} execute "
                     f"{point['in_server_execute_us']}" if "in_server_run_us" in point else ""), flush=True)
    finally:
        base.stop(proc)
    return out


TIMER_NS = 0.0


def account_of(served: float, no_model: float, in_server_parse: float, in_server_run: float,
               bare: dict[str, float]) -> tuple[float, dict[str, float]]:
    """The gap of a served request's CPU over the bare loop's (us per request), split into the server's own
    work (the ``no_model`` variant), the parse's and the run's excess inside the server over the bare loop's,
    and what is left; the parts sum to the gap."""
    if min(served, no_model, in_server_parse, in_server_run, *bare.values()) <= 0:
        raise ValueError(f"CPU figures must be positive: served {served}, no_model {no_model}, parse "
                         f"{in_server_parse}, run {in_server_run}, bare {bare}")
    gap = served - bare["whole"]
    parts = {"server_own_work": no_model,
             "parse_slower_in_server": round(in_server_parse - bare["parse"], 1),
             "run_slower_in_server": round(in_server_run - bare["run"], 1)}
    parts["rest"] = round(gap - sum(parts.values()), 1)
    return round(gap, 1), parts


def main() -> None:
    global TIMER_NS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--anchors", help="folder holding bin/perf_analyzer (and bin/tritonserver)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--protocols", nargs="+", default=["http", "grpc"], choices=["http", "grpc"])
    ap.add_argument("--measure-ms", type=int, default=3000)
    args = ap.parse_args()
    bin_dir = base.anchors(args.anchors)
    TIMER_NS = timer_ns()
    work = Path(tempfile.mkdtemp(prefix="azulite-bench-dlrm-account-"))
    try:
        print("== building the exported DLRM (one step) ...", flush=True)
        bm = sm.build_dlrm(work / "dlrm", "fused")
        repos = {}
        for name, tail in VARIANTS.items():
            repos[name] = work / f"repo-{name}"
            shutil.copytree(bm.repo, repos[name])
            with (repos[name] / "dlrm" / "1" / "model.py").open("a") as f:
                f.write(tail)
        figures: dict = {name: {p: [] for p in args.protocols} for name in VARIANTS}
        bare: dict = {"whole": [], "parse": [], "run": []}
        for rnd in range(args.rounds):
            order = list(VARIANTS) if rnd % 2 == 0 else list(VARIANTS)[::-1]
            print(f"== round {rnd + 1}/{args.rounds} (load {os.getloadavg()[0]:.1f})", flush=True)
            for name in order:
                for protocol, point in measure_variant(name, repos[name], bin_dir, args.protocols, args.measure_ms,
                                                       work, bm.input_data).items():
                    figures[name][protocol].append(point)
            for part, us in bare_parts(bm.repo, args.measure_ms / 1000).items():
                bare[part].append(us)
            print(f"  bare loop, 64-row batches: whole {bare['whole'][-1]:.1f}  parse {bare['parse'][-1]:.1f}  "
                  f"run {bare['run'][-1]:.1f} us per 32 rows", flush=True)
        med = statistics.median
        bare_med = {k: round(med(v), 1) for k, v in bare.items()}
        account: dict = {}
        for protocol in args.protocols:
            def m(name: str, key: str) -> float | None:
                vals = [p[key] for p in figures[name][protocol] if key in p]
                return round(med(vals), 1) if vals else None
            served, none = m("served", "server_us_per_request"), m("no_model", "server_us_per_request")
            parse, run = m("timed", "in_server_parse_us"), m("timed", "in_server_run_us")
            if None in (served, none, parse, run):
                continue
            gap, parts = account_of(served, none, parse, run, bare_med)
            account[protocol] = {"served_us_per_request": served, "bare_us_per_request": bare_med["whole"],
                                 "gap_us_per_request": round(gap, 1), "parts": parts,
                                 "no_onnx_us_per_request": m("no_onnx", "server_us_per_request"),
                                 "server_sys_us_per_request": m("served", "server_sys_us_per_request"),
                                 "client_us_per_request": m("served", "client_us_per_request"),
                                 "batch_rows": m("served", "batch_rows"),
                                 "in_server": {"parse": parse, "run": run,
                                               "execute": m("timed", "in_server_execute_us")}}
            print(f"== {protocol}: served {served} us per 32-row request, bare {bare_med['whole']}: "
                  f"gap {gap:.1f} = "
                  + " + ".join(f"{k} {v}" for k, v in parts.items()), flush=True)
        print(json.dumps({"bench": "dlrm_serve_account", "rows_per_request": ROWS, "concurrency": CONCURRENCY,
                          "thread_time_ns_call": round(TIMER_NS), "bare_us_per_request": bare_med,
                          "account": account, "points": figures}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
