"""``azulite serve --workers 1`` and ``--workers 2`` beside real Triton 2.51, driven by perf_analyzer over
HTTP and gRPC at concurrency 1, 8 and 32, on two Python-backend models that run unchanged on all three:

- ``bench_matmul``: x FP32 [256] times a fixed 256x256 W (numpy: releases the GIL in the kernel),
  max_batch_size 64, dynamic batching 100 us, one instance (tests/serve/models/bench_matmul);
- ``gil_py``: holds the GIL ~1 ms per batch in pure Python, then echoes x; max_batch_size 64, dynamic
  batching 100 us, two instances, each in its own process on all three servers (Triton's Python stubs;
  azulite's ``azulite_instance_process: "true"``, serve/instances.py, with ``--workers 1`` too).

On ``--workers 1`` only, the A/B behind the default of ``azulite_instance_process`` ("auto": threads in
a single-process server): ``gil_py_threads`` (gil_py as two threads of the server) and
``bench_matmul_proc`` (bench_matmul's one instance in a process of its own), each point measured right
after its twin, so ``instance_process_ab`` compares processes with threads under the same load; and
``default_placement_over_triton`` gives ``gil_py_threads`` (what a user who keeps the default gets)
against Triton's gil_py, round by round, with its own ``default_placement_goals``.

Per point: throughput and p99 (perf_analyzer), and the server's CPU-seconds per 1,000 inferences (the
/proc times of its whole process tree over the run, divided by the inferences its statistics counted
over the same run). perf_analyzer is pinned (taskset) to the last core (``--no-pin``: not); the servers
may use every core; ``cores`` gives how many cores each side used on average (CPU-seconds / wall
seconds). ``--load-generator h2load`` drives every point with h2load instead (bench/h2load.py: one fixed
request, less CPU per request than perf_analyzer; the servers' own counts are what the CPU per inference
divides by). The last line is one JSON object with the ratios and goals: >= 1.0x Triton's throughput
everywhere, CPU per inference <= Triton's, and on gil_py ``--workers 2`` >= 1.6x ``--workers 1``.

Per point also the batches each server formed (``batch_avg``: inferences / executions, from its own
statistics) and how busy its instances were (``instance_busy``: the model's execution time summed over
batch_stats, over the point's wall time and the model's instance count; below 1, an instance waited for
a batch). Not the same clock on both: Triton's Python backend times an execution in the server around
its round trip to the stub (the crossing and the stub's wake-up included), azulite in the instance process
around the model's execute (neither included), so at equal idle time Triton's reads higher. With a model
whose time is per batch (gil_py), these two and the CPU per inference by role are what say where one
server answers less than the other. With ``--workers N > 1``: ``coalesced_share`` (the requests that
reached the model host coalesced by a front-end, serve/coalesce.py) and ``coalesced_mean`` (requests per
coalesced one), from the host's ``azulite_coalesced_*`` counters.

Per point the server's CPU is also split by role (``cores`` and ``cpu_us_per_inference_by_role``: main,
host, frontends, instances; Triton's Python stubs count as its instances), which is what the arithmetic of
the ``--workers 2`` / ``--workers 1`` goal needs. ``--ab-src OTHER/src`` serves ``--workers 1`` and ``2``
from another checkout too (base_w1, base_w2), each point right after the same point of this one:
``ab_over_base`` gives this checkout's throughput and CPU per inference over that one's.

``--gaps``: gil_py stamps the start and end of each execute (same model code on every server), and per
point ``gaps_us`` gives how long its instance processes sat between one batch's end and the next one's
start (percentiles over both instances, the crossing both ways and the server's work between included),
the measure behind ``instance_busy`` that reads the same clock on azulite and Triton.

Per point also who waited for a CPU while a core sat idle (bench/sched_waits.py): ``runqueue_wait_cores``
by role (the server's, and ``load_generator``: runnable, not running) and ``idle_cores`` per CPU, each
seconds over the point's wall seconds.

``--rounds N`` measures every point N times in turn (each server once per round, so a change in the
machine's load hits all alike; every other round in reverse order, so none always follows the same one);
``ratio`` (to Triton in the same round) and ``ab_over_base`` then give each round's ratios and their
median (on a loaded machine one pair says little). ``--serve-workers 1`` leaves ``--workers 2`` out.

    python bench/serving.py --workers [--anchors DIR] [--concurrency 1 8 32] [--measure-ms 1500]
                            [--models gil_py] [--ab-src OTHER/src] [--no-twins] [--gaps]
                            [--rounds N] [--serve-workers 1 2 [4 8 ...]] [--protocols http grpc]
                            [--instance-nice N] [--no-pin] [--load-generator h2load [--json-outputs] [--json-inputs]]
                            [--load-cores K] [--server-cores all|rest] [--no-triton]

On a machine with many cores: ``--load-cores K`` pins the load generator to the last K cores (one core of
perf_analyzer caps every server there), ``--server-cores rest`` pins every server to the other cores, and
``--serve-workers`` takes any counts; ``workers_over_workers1`` gives each N over ``--workers 1`` and
``best_workers_over_triton`` the best N per point against Triton (16 cores, stop 43: docs/perf-workers.md).

``--json-outputs`` / ``--json-inputs`` (with h2load, HTTP only): the request asks for its outputs as JSON
numbers / sends its inputs as JSON numbers, not binary (both: a client without the binary extension).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench import h2load
from bench.sched_waits import SchedWaits
from bench.server_procs import instance_pids, kill_strays, point_roles, tree_cpu
from bench.serving import ROOT, anchors, free_port, perf_run, server_cmd, start_server, stop
from tests.serve.conftest import build_model_repository

MODELS = ("bench_matmul", "gil_py")
#: A/B twins measured on --workers 1 only: (twin, of model, instances in processes?)
TWINS = (("gil_py_threads", "gil_py", False), ("bench_matmul_proc", "bench_matmul", True))
INSTANCE_PARAM = 'parameters {{ key: "azulite_instance_process" value: {{ string_value: "{}" }} }}\n'
GIL_PY = '''
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:  # pure Python: holds the GIL for the whole millisecond
            pass
        return [pb_utils.InferenceResponse(
                    [pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy())]) for r in requests]
'''
#: gil_py under --gaps: the same, and each execute's start and end (CLOCK_MONOTONIC ns, the clock of the
#: bench's time.monotonic_ns) appended to gaps-<pid>.bin in the model's folder, one write per batch (a few
#: µs against the 1 ms the batch holds the GIL, the same on every server)
GIL_PY_STAMPED = GIL_PY.replace("import time\n", "import os\nimport struct\nimport time\n").replace(
    "    def execute(self, requests):\n",
    "    def initialize(self, args):\n"
    "        self._fd = os.open(os.path.join(args['model_repository'], f'gaps-{os.getpid()}.bin'),\n"
    "                           os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)\n\n"
    "    def execute(self, requests):\n"
    "        start = time.monotonic_ns()\n").replace(
    "        return [pb_utils.InferenceResponse(",
    "        responses = [pb_utils.InferenceResponse(").replace(
    "for r in requests]\n",
    "for r in requests]\n"
    "        os.write(self._fd, struct.pack('<qq', start, time.monotonic_ns()))\n"
    "        return responses\n")
GIL_CONFIG = '''
name: "gil_py"
backend: "python"
max_batch_size: 64
input [ { name: "x" data_type: TYPE_FP32 dims: [ 256 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 256 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
instance_group [ { count: 2 kind: KIND_CPU } ]
'''
def gaps(model_dir: Path, pids: list[int], t0_ns: int, t1_ns: int) -> dict:
    """How long each instance process sat between one execute's end and the next one's start (ns stamps
    from GIL_PY_STAMPED, in the same clock on every server) within [t0_ns, t1_ns]: the crossing both ways,
    the server's own work between an answer and the next batch, and any wait for requests. Percentiles in
    µs over every instance's gaps, and their share of the window."""
    found: list[int] = []
    busy = seen = 0
    for pid in pids:
        try:
            raw = (model_dir / f"gaps-{pid}.bin").read_bytes()
        except OSError:  # an instance of another model
            continue
        seen += 1
        stamps = np.frombuffer(raw[:len(raw) // 16 * 16], dtype="<i8").reshape(-1, 2)
        stamps = stamps[(stamps[:, 0] >= t0_ns) & (stamps[:, 1] <= t1_ns)]
        busy += int((stamps[:, 1] - stamps[:, 0]).sum())
        found += (stamps[1:, 0] - stamps[:-1, 1]).tolist()
    if not found:
        return {}
    us = np.array(found) / 1000
    return {"n": len(found), "instances": seen, "mean_us": round(float(us.mean()), 1),
            **{f"p{q}_us": round(float(np.percentile(us, q)), 1) for q in (10, 50, 90, 99)},
            "execute_share": round(busy / max(1, (t1_ns - t0_ns) * seen), 3)}


#: instances per model (instance_group count), for how busy each was
INSTANCES = {"bench_matmul": 1, "gil_py": 2, "gil_py_threads": 2, "bench_matmul_proc": 1}


def counts(http_port: int, model: str) -> tuple[int, int, int]:
    """(inferences, batches executed, ns the model spent executing them) so far, from the server's own
    statistics (Triton's format on both; the time summed over batch_stats, once per batch)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/{model}/stats", timeout=30) as r:
        doc = json.loads(r.read())
    return (sum(int(s.get("inference_count", 0)) for s in doc["model_stats"]),
            sum(int(s.get("execution_count", 0)) for s in doc["model_stats"]),
            sum(int(b.get("compute_infer", {}).get("ns", 0)) for s in doc["model_stats"] for b in s.get("batch_stats", ())))


def coalesced(metrics_port: int, model: str) -> tuple[float, float]:
    """(client requests that reached the model host coalesced, the coalesced requests carrying them) so far:
    ``--workers N > 1`` (serve/coalesce.py); (0, 0) for a server without them."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return 0.0, 0.0
    requests = groups = 0.0
    for line in text.splitlines():
        if f'model="{model}"' not in line:
            continue
        if line.startswith("azulite_coalesced_requests_total{"):
            requests += float(line.rsplit(" ", 1)[1])
        elif line.startswith("azulite_coalesced_total{"):
            groups += float(line.rsplit(" ", 1)[1])
    return requests, groups


def inference_count(http_port: int, model: str) -> int:
    return counts(http_port, model)[0]


#: a ratio's name -> how to read it from one point's figures
RATIO_OF = {"throughput": lambda r: r["infer_per_s"], "p99": lambda r: r["p99_ms"],
            "cpu_per_inference": lambda r: r["cpu_s_per_1k"], "gap_p50": lambda r: r["gaps_us"]["p50_us"],
            "execute_share": lambda r: r["gaps_us"]["execute_share"]}


def median_of_rounds(pairs: list[tuple[dict, dict]], names: tuple[str, ...]) -> dict:
    """Per name, the median over the rounds of ``a / b`` for each round's pair of points (and, with more
    than one round, every round's ratio under ``rounds``)."""
    each = {k: [RATIO_OF[k](a) / RATIO_OF[k](b) for a, b in pairs] for k in names}
    out: dict = {k: round(float(np.median(v)), 3) for k, v in each.items()}
    if len(pairs) > 1:
        out["rounds"] = {k: [round(x, 3) for x in v] for k, v in each.items()}
    return out


def default_placement_over_triton(rounds: dict) -> tuple[dict, dict | None]:
    """``gil_py_threads`` (azulite's default placement with ``--workers 1``: "auto" means threads there)
    against Triton's gil_py (always processes), round by round, as a user who keeps the default would
    compare; bench_matmul's own points are its default already. ``rounds``: (server, point) -> each
    round's figures. Returns the ratios per twin point and their goals (None: no twin point measured)."""
    default: dict = {}
    goals = {"throughput_ge_triton": True, "cpu_le_triton": True}
    for twin, model, processes in TWINS:
        if processes:
            continue
        for (server, key), triton in rounds.items():
            if server != "triton" or not key.startswith(model + "_"):
                continue
            twin_key = twin + key[len(model):]
            pairs = list(zip(rounds.get(("azulite_w1", twin_key), []), triton))
            if not pairs or any("cpu_s_per_1k" not in a or "cpu_s_per_1k" not in t for a, t in pairs):
                continue
            default[twin_key] = median_of_rounds(pairs, ("throughput", "p99", "cpu_per_inference"))
            goals["throughput_ge_triton"] &= default[twin_key]["throughput"] >= 1.0
            goals["cpu_le_triton"] &= default[twin_key]["cpu_per_inference"] <= 1.0
    return default, (goals if default else None)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", action="store_true", help="(how bench/serving.py hands over)")
    ap.add_argument("--anchors", help="folder holding bin/tritonserver and bin/perf_analyzer")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--measure-ms", type=int, default=1500)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--ab-src", help="A/B: also serve with --workers 1 and 2 from this other checkout's src/ "
                    "(base_w1, base_w2), each point measured right after the same point of this one")
    ap.add_argument("--no-twins", action="store_true", help="skip the processes/threads twins on --workers 1")
    ap.add_argument("--gaps", action="store_true", help="gil_py stamps each execute: per point, the instances' "
                    "idle gaps between batches (gaps_us), on every server alike")
    ap.add_argument("--rounds", type=int, default=1, help="measure every point this many times, in turn")
    ap.add_argument("--serve-workers", type=int, nargs="+", default=[1, 2],
                    help="which `azulite serve --workers N` to measure (1 must be among them: the ratios are to it)")
    ap.add_argument("--protocols", nargs="+", default=["http", "grpc"], choices=["http", "grpc"])
    ap.add_argument("--instance-nice", type=int, help="gil_py's instance processes at this nice value "
                    "(config parameter azulite_instance_nice; with --ab-src, an older tree ignores it)")
    ap.add_argument("--load-generator", choices=["perf_analyzer", "h2load"], default="perf_analyzer",
                    help="h2load: nghttp2's load generator instead (less CPU per request on the shared cores; "
                    "bench/h2load.py), measured for 3x --measure-ms after a 1 s warm-up")
    ap.add_argument("--json-outputs", action="store_true", help="h2load's HTTP requests ask for their outputs as "
                    "JSON numbers (a client without the binary extension: curl, most REST clients) instead of binary; "
                    "needs --load-generator h2load and --protocols http")
    ap.add_argument("--json-inputs", action="store_true", help="h2load's HTTP requests send their inputs as JSON "
                    "numbers (with --json-outputs: a client without the binary extension, both ways)")
    ap.add_argument("--no-pin", action="store_true", help="leave perf_analyzer on every core (default: pinned to "
                    "the last; on 2 cores a server's process running there keeps it waiting while the other "
                    "core may idle: idle_cores and runqueue_wait_cores say how much)")
    ap.add_argument("--load-cores", type=int, default=1, help="pin the load generator to this many of the last "
                    "cores (default 1; on a machine with many cores one core of perf_analyzer caps every server)")
    ap.add_argument("--server-cores", choices=["all", "rest"], default="all",
                    help="rest: pin every server to the cores the load generator does not use (default all: the "
                    "servers may use every core, the load generator's too)")
    ap.add_argument("--no-triton", action="store_true", help="azulite alone (where Triton cannot run): the "
                    "--workers N ratios to --workers 1, no ratio to Triton")
    args = ap.parse_args(argv)
    if 1 not in args.serve_workers or any(w < 1 for w in args.serve_workers):
        ap.error("--serve-workers: positive counts, 1 among them (the scaling ratios are to --workers 1)")
    if (args.json_outputs or args.json_inputs) and (args.load_generator != "h2load" or args.protocols != ["http"]):
        ap.error("--json-outputs / --json-inputs: JSON tensors are HTTP's and perf_analyzer sends and asks for "
                 "binary ones: add --load-generator h2load --protocols http")
    bin_dir = anchors(args.anchors)
    cores = sorted(os.sched_getaffinity(0))
    load_cores = max(1, min(args.load_cores, len(cores) - 1))
    pin = [] if len(cores) < 2 or args.no_pin else ["taskset", "-c", ",".join(map(str, cores[-load_cores:]))]
    server_pin = (["taskset", "-c", ",".join(map(str, cores[:-load_cores]))]
                  if pin and args.server_cores == "rest" else [])
    work = Path(tempfile.mkdtemp(prefix="azulite-bench-workers-"))
    try:
        repo = build_model_repository(work / "repo", ("bench_matmul",))
        (repo / "gil_py" / "1").mkdir(parents=True)
        nice = ("" if args.instance_nice is None else
                f'parameters {{ key: "azulite_instance_nice" value: {{ string_value: "{args.instance_nice}" }} }}\n')
        (repo / "gil_py" / "config.pbtxt").write_text(GIL_CONFIG + INSTANCE_PARAM.format("true") + nice)
        (repo / "gil_py" / "1" / "model.py").write_text(GIL_PY_STAMPED if args.gaps else GIL_PY)
        for twin, model, processes in TWINS:
            shutil.copytree(repo / model, repo / twin)
            config = (repo / twin / "config.pbtxt").read_text().replace(f'name: "{model}"', f'name: "{twin}"')
            config = config.replace(INSTANCE_PARAM.format("true"), "")
            (repo / twin / "config.pbtxt").write_text(config + INSTANCE_PARAM.format("true" if processes else "false"))
        data = work / "input.json"
        values = np.random.default_rng(0).uniform(-1, 1, 256).astype(np.float32).round(4).tolist()
        data.write_text(json.dumps({"data": [{"x": {"content": values, "shape": [256]}}]}))
        h2_bodies = {model: h2load.bodies(work, model, {"x": np.array([values], np.float32)},
                                          binary_outputs=not args.json_outputs, json_inputs=args.json_inputs)
                     for model in {*args.models, *(twin for twin, model, _ in TWINS if model in args.models)}}
        pa = bin_dir / "perf_analyzer"
        servers: dict[str, tuple[subprocess.Popen, int, int]] = {}
        figures: dict = {}
        rounds: dict[tuple[str, str], list[dict]] = {}  # (server, point) -> each round's figures
        try:
            names = [*([] if args.no_triton else ["triton"]),
                     *(f"{side}_w{w}" for w in args.serve_workers for side in ("azulite", "base"))]
            for name in names if args.ab_src else [n for n in names if not n.startswith("base_")]:
                for attempt in (1, 2):
                    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
                    extra = () if name == "triton" else ("--workers", name.rsplit("_w", 1)[1])
                    cmd = [*server_pin, *server_cmd(name, bin_dir, repo, http_port, grpc_port, metrics_port, *extra)]
                    if name.startswith("base_"):  # env execs the server: its pid is the server's
                        cmd = ["env", f"PYTHONPATH={Path(args.ab_src).resolve()}", *cmd]
                    print(f"starting {name} ...", flush=True)
                    try:
                        servers[name] = (start_server(name, cmd, http_port, work), http_port, grpc_port, metrics_port)
                        break
                    except (RuntimeError, TimeoutError) as exc:
                        if attempt == 2:
                            raise
                        # once more (seen once here: tritonserver aborted at start-up, then started fine),
                        # its orphans ended first; the end of its log shown (the run's folder goes at the end)
                        tail = (work / f"{name}.log").read_text(errors="replace")[-600:]
                        kill_strays(work, orphans_only=True)
                        print(f"  {name} did not start ({exc}): once more; its log ended with:\n{tail}", flush=True)
                figures[name] = {}
            # every server stays up; each point is measured on one, then the next, so a change in the
            # machine's load between points hits all of them alike
            twins = {model: twin for twin, model, _ in TWINS}
            for model in args.models:
                for protocol in args.protocols:
                    for c in args.concurrency:
                        runs = [(name, model) for name in servers] + ([] if args.no_twins else [("azulite_w1", twins[model])])
                        # odd rounds in reverse order: no server always measured right after the same one
                        for name, point_model in [run for i in range(args.rounds) for run in (runs[::-1] if i % 2 else runs)]:
                            proc, http_port, grpc_port, metrics_port = servers[name]
                            port = http_port if protocol == "http" else grpc_port
                            merged0 = coalesced(metrics_port, point_model) if name != "triton" else (0.0, 0.0)
                            (n0, b0, e0), cpu0, t0 = counts(http_port, point_model), tree_cpu(proc.pid), time.monotonic()
                            t0_ns = time.monotonic_ns()
                            pa0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                            with SchedWaits(point_roles(proc.pid)) as waits:
                                if args.load_generator == "h2load":
                                    r = h2load.run(point_model, protocol, port, c, h2_bodies[point_model][protocol], work,
                                                   duration_s=3 * args.measure_ms / 1000, warm_up_s=1, prefix=pin)
                                else:
                                    r = perf_run(pa, point_model, protocol, port, c, data, args.measure_ms, work, prefix=pin)
                            pa1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                            wall = time.monotonic() - t0
                            if args.gaps and point_model == "gil_py":
                                r["gaps_us"] = gaps(repo / "gil_py", instance_pids(proc.pid), t0_ns, time.monotonic_ns())
                            cpu1 = tree_cpu(proc.pid)
                            roles = {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1}
                            cpu = sum(roles.values())
                            n1, b1, e1 = counts(http_port, point_model)
                            n, batches = n1 - n0, b1 - b0
                            merged1 = coalesced(metrics_port, point_model) if name != "triton" else (0.0, 0.0)
                            if "done" in r and n < r["done"]:  # h2load: a gRPC error is a 200 to it; the server's count is not
                                r = {"error": f"the server counted {n} inferences for the {r['done']} requests h2load saw answered"}
                            if "error" not in r and n > 0:
                                load = (pa1.ru_utime + pa1.ru_stime) - (pa0.ru_utime + pa0.ru_stime)
                                # the CPU each side used: the server by role, and the load generator
                                # the batches each server formed (a GIL-bound model's time is per batch)
                                # and how busy their instances were (the model's own time over the run's wall time,
                                # per instance): below 1 an instance sat idle while requests were on their way
                                r.update(cpu_s_per_1k=round(cpu / n * 1000, 4), batch_avg=round(n / max(batches, 1), 2),
                                         instance_busy=round((e1 - e0) / 1e9 / wall / INSTANCES[point_model], 3),
                                         cores={"server": round(cpu / wall, 2), "load_generator": round(load / wall, 2),
                                                **{f"server_{k}": round(v / wall, 2) for k, v in sorted(roles.items())}},
                                         cpu_us_per_inference_by_role={k: round(v / n * 1e6, 1) for k, v in sorted(roles.items())},
                                         **waits.figures(wall))
                                if merged1[1] > merged0[1]:  # the front-ends' coalescing (serve/coalesce.py)
                                    r.update(coalesced_share=round((merged1[0] - merged0[0]) / n, 3),
                                             coalesced_mean=round((merged1[0] - merged0[0]) / (merged1[1] - merged0[1]), 2))
                            figures[name][f"{point_model}_{protocol}_c{c}"] = r
                            rounds.setdefault((name, f"{point_model}_{protocol}_c{c}"), []).append(r)
                            shown = (f"{r['infer_per_s']:>9.1f} infer/s  p99 {r['p99_ms']:7.3f} ms  "
                                     f"cpu {r.get('cpu_s_per_1k', float('nan')):.3f} s/1k  batch {r.get('batch_avg')}  busy {r.get('instance_busy')}  cores {r.get('cores')}"
                                     + (f"  gaps {r['gaps_us']}" if "gaps_us" in r else "")
                                     + (f"  waiting {r['runqueue_wait_cores']} idle {r['idle_cores']}" if "idle_cores" in r else "")
                                     if "error" not in r else f"error: {r['error']}")
                            print(f"  {name:10s} {point_model:17s} {protocol:4s} c={c:<3d} {shown}", flush=True)
        finally:
            for proc, *_ in servers.values():
                stop(proc)
        ratio: dict = {}
        goals = {"throughput_ge_triton": True, "cpu_le_triton": True}
        for name in (f"azulite_w{w}" for w in args.serve_workers):
            ratio[name] = {}
            for key in figures.get("triton", {}):
                # each round's pair (this server and Triton in the same round), and their median
                pairs = list(zip(rounds.get((name, key), []), rounds.get(("triton", key), [])))
                if not pairs or any("cpu_s_per_1k" not in a or "cpu_s_per_1k" not in t for a, t in pairs):
                    goals["throughput_ge_triton"] = goals["cpu_le_triton"] = False
                    continue
                ratio[name][key] = median_of_rounds(pairs, ("throughput", "p99", "cpu_per_inference"))
                goals["throughput_ge_triton"] &= ratio[name][key]["throughput"] >= 1.0
                goals["cpu_le_triton"] &= ratio[name][key]["cpu_per_inference"] <= 1.0
        # every --workers N over --workers 1 (each model), and per point the best N against Triton: on a
        # machine with many cores the question is whether some N holds the lead, not whether each does
        growth: dict = {}
        for w in args.serve_workers:
            for key, w1 in figures.get("azulite_w1", {}).items():
                wn = figures.get(f"azulite_w{w}", {}).get(key)
                if w > 1 and wn is not None and "error" not in w1 and "error" not in wn:
                    growth.setdefault(f"w{w}", {})[key] = round(wn["infer_per_s"] / w1["infer_per_s"], 3)
        best: dict = {}
        for key, triton in figures.get("triton", {}).items():
            found = [(figures[f"azulite_w{w}"][key]["infer_per_s"], w) for w in args.serve_workers
                     if "error" not in figures.get(f"azulite_w{w}", {}).get(key, {"error": 1})]
            if found and "error" not in triton:
                top, w = max(found)
                best[key] = {"workers": w, "throughput": round(top / triton["infer_per_s"], 3)}
        goals["best_workers_ge_triton"] = bool(best) and all(v["throughput"] >= 1.0 for v in best.values())
        if "triton" not in figures:  # --no-triton: nothing to compare with
            goals.update(throughput_ge_triton=None, cpu_le_triton=None, best_workers_ge_triton=None)
        scaling = {}
        for key, w1 in figures.get("azulite_w1", {}).items():
            w2 = figures.get("azulite_w2", {}).get(key)
            if key.startswith("gil_py") and w2 is not None and "error" not in w1 and "error" not in w2:
                scaling[key] = round(w2["infer_per_s"] / w1["infer_per_s"], 3)
        # What --workers 2 could reach at most on these cores: all of them busy (server and load generator)
        # at the CPU per inference --workers 2 was measured to cost: cores / (w2's server + w1's load
        # generator CPU per inference), over w1's throughput. Below 1.6 the goal is out of reach here
        # whatever the crossing does (docs/perf-workers.md: "What --workers 2 / --workers 1 needs").
        ceiling = {}
        for key in scaling:
            w1, w2 = figures["azulite_w1"][key], figures["azulite_w2"][key]
            if "cores" in w1 and "cpu_s_per_1k" in w2:
                generator_s = w1["cores"]["load_generator"] / w1["infer_per_s"]
                ceiling[key] = round(len(cores) / (w2["cpu_s_per_1k"] / 1000 + generator_s) / w1["infer_per_s"], 3)
        # at c=1 one request is in flight at a time: no parallel batches to run, nothing for a second
        # instance process to do (the 1.6x goal is for the concurrent points)
        goals["gil_workers2_ge_1.6x_workers1"] = bool(scaling) and all(
            v >= 1.6 for k, v in scaling.items() if not k.endswith("_c1"))
        # processes over threads, same server (--workers 1), same point, measured back to back
        ab = {}
        for twin, model, processes in TWINS:
            for key, a in figures.get("azulite_w1", {}).items():
                if not key.startswith(model + "_") or key.startswith(twin):
                    continue
                b = figures["azulite_w1"].get(twin + key[len(model):], {})
                proc_r, thread_r = (b, a) if processes else (a, b)
                if "cpu_s_per_1k" in proc_r and "cpu_s_per_1k" in thread_r:
                    ab[key] = {"throughput": round(proc_r["infer_per_s"] / thread_r["infer_per_s"], 3),
                               "cpu_per_inference": round(proc_r["cpu_s_per_1k"] / thread_r["cpu_s_per_1k"], 3)}
        default, default_goals = default_placement_over_triton(rounds)
        base = {}  # this checkout over --ab-src, same point, measured back to back (each round, and the median)
        for w in ("w1", "w2"):
            for key in figures.get(f"azulite_{w}", {}):
                pairs = [(a, b) for a, b in zip(rounds.get((f"azulite_{w}", key), []), rounds.get((f"base_{w}", key), []))
                         if "cpu_s_per_1k" in a and "cpu_s_per_1k" in b]
                if not pairs:
                    continue
                with_gaps = all(a.get("gaps_us") and b.get("gaps_us") for a, b in pairs)
                base[f"{w}_{key}"] = median_of_rounds(pairs, ("throughput", "cpu_per_inference",
                                                              *(("gap_p50", "execute_share") if with_gaps else ())))
        if base:
            print("this checkout / --ab-src:", json.dumps(base, indent=1))
        print("\nratios to triton:", json.dumps(ratio, indent=1))
        print("--workers 1, instance processes / threads:", json.dumps(ab, indent=1))
        if default:
            print("--workers 1, gil_py as threads (the default placement) over Triton's gil_py:", json.dumps(default, indent=1))
        print("gil_py workers 2 / workers 1:", scaling, "at most (all cores busy):", ceiling)
        print("--workers N / --workers 1:", json.dumps(growth, indent=1))
        print("best --workers N over Triton:", json.dumps(best, indent=1))
        print(json.dumps({"bench": "serving_workers", "models": args.models, "concurrency": args.concurrency,
                          "inputs": "json" if args.json_inputs else "binary",
                          "outputs": "json" if args.json_outputs else "binary",
                          "load_generator_pinned_to": pin[2] if pin else None, "cores": len(cores),
                          "loadavg": os.getloadavg(), "figures": figures, "ratio": ratio,
                          "gil_workers2_over_workers1": scaling, "gil_workers2_over_workers1_ceiling": ceiling,
                          "workers_over_workers1": growth, "best_workers_over_triton": best,
                          "server_pinned_to": server_pin[2] if server_pin else None,
                          "instance_process_ab_workers1": ab,
                          "default_placement_over_triton": default,
                          "default_placement_goals": default_goals,
                          "ab_over_base": base,
                          "goals": goals}))
    finally:
        strays = kill_strays(work)
        if strays:
            print(f"ended {len(strays)} process(es) the servers left behind: {strays}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
