"""Serving exported models: azulite serve vs real Triton 2.51 on the same exported repository, and vs a
bare in-process onnxruntime session (the limit), driven by Triton's own perf_analyzer over HTTP and gRPC
at concurrency 1, 8 and 32 (one row per request; dynamic batching merges them).

- DLRM: a checkpoint of the example job's model shape (26 tables x 1000 rows x 8, dense 32-8, over 32-1;
  untrained: speed does not depend on the weights) exported by ``azulite export`` exactly as a trained
  one is, by default as the one-step pipeline (``--pipeline fused``): ``dlrm``, a Python-backend model
  parsing the raw Criteo TSV rows and running its model.onnx with onnxruntime (one thread) in one execute.
  ``--dlrm-pipeline ensemble``: the ensemble ``dlrm`` = ``dlrm_preprocess`` (Python: raw row -> int64) ->
  ``dlrm_model`` (ONNX). Clients send raw rows either way.
- Real Triton here has only its Python backend: it serves the same repository (the one-step model.py runs
  unchanged there; an ensemble's ONNX model is wrapped in a model.py running the same model.onnx with
  onnxruntime, azulite.export.wrappers), one intra-op thread, as azulite's sessions.
- The bare session: the same preprocessing function and an onnxruntime session (1 thread) in this
  process, on batches of c rows for concurrency c: what dynamic batching could at best merge, with no
  server at all. Beside its rows/s: its CPU per row (``bare_cpu_us_per_row``), and per point the server's
  CPU per row over it (``vs_bare_cpu_per_row``: what is above 1 is the server's own work per row) and
  the rows per execution each model's batcher really formed (``batch_rows``, from the servers'
  statistics), so a gap to the limit reads as either work per row or smaller batches.
- The ceiling: the bare loop has a core to itself and no client, while a served point shares the
  machine's cores with perf_analyzer. Per point, perf_analyzer's own CPU per row (``client_cpu_us_per_row``,
  its reaped process's user + system time, over the rows the server answered) and from it
  ``ceiling_vs_bare`` beside ``vs_bare_throughput``: cores / (client CPU per row + the bare loop's CPU per
  row), over the bare rows/s -- what a server doing nothing but the model's own work could reach here.

- ARR-COC: the ``arrcoc`` ensemble of examples/arrcoc (ten steps: Pillow decode, five ONNX models,
  tokenizer, opponent processor, decoder, detokenizer), trained and built here by its build_repository.py
  (a few minutes); clients send the shipped PNGs (raw bytes) and their queries. Real Triton serves the
  example's --triton-python copy; the bare limit runs every step on the whole batch in this process.

More models join through MODELS, a list of (name, builder): a builder gets a work folder and returns a
BenchModel.
Both servers stay up; each point is measured on one, then the other, so a change in the machine's load
hits both alike. The last line printed is one JSON object.

    python bench/serve_models.py [--anchors DIR] [--concurrency 1 8 32] [--measure-ms 3000] [--models dlrm]
                                 [--rows-per-request N] [--dlrm-pipeline fused|ensemble]

Rows per request: 1 by default (every request one row or image, the hardest case for a server: its
per-request protocol work is all there is to amortise). A DLRM ranking request scores a user's candidate
items together, so ``--rows-per-request 32`` is the realistic shape for it; the bare limit then runs on the
largest batch dynamic batching could form from c such requests (at most the model's max_batch_size).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import serving as base  # noqa: E402 - bench/serving.py: ports, server start/stop, perf_analyzer runs
from server_procs import tree_cpu_s  # noqa: E402 - a server's CPU per inference
from serving_workers import inference_count  # noqa: E402


#: the cores a served point's server and client share (the bare loop uses one)
CORES = len(os.sched_getaffinity(0))


@dataclass
class BenchModel:
    #: the repository azulite serves (as exported); real Triton serves its Python-backend copy
    repo: Path
    #: the model clients call
    model: str
    #: perf_analyzer --input-data JSON and --shape arguments
    input_data: Path
    shape_args: list[str]
    #: (rows/s, CPU us per row) of the in-process limit on batches of ``b`` rows, measured for about ``seconds``
    bare: Callable[[int, float], tuple[float, float]]
    #: the copy real Triton serves; None: azulite.export.wrappers.python_backend_copy of ``repo``
    triton_repo: Path | None = None
    #: the ensemble's max_batch_size: the most rows one execution can merge
    max_batch: int = 64


#: how the DLRM pipeline is exported (azulite export --pipeline): both servers serve the same repository
DLRM_PIPELINE = "fused"


def build_dlrm(work: Path, pipeline: str | None = None) -> BenchModel:
    from azulite import train
    from azulite.export import ExportOptions, export_checkpoint
    from azulite.export.dlrm import PREPROCESS_MODEL_PY, sample_rows
    from azulite.workloads.dlrm.model import DLRMConfig, build_model

    cfg = DLRMConfig(num_embeddings_per_feature=(1000,) * 26, embedding_dim=8, dense_arch_layer_sizes=(32, 8),
                     over_arch_layer_sizes=(32, 1))
    ctx = train.init(seed=0)
    model = build_model(**cfg.kwargs())
    ckpt = train.Checkpointer(train.CheckpointConfig(uri=str(work / "ckpt"), interval=0, model_config=cfg.model_config()),
                              ctx, state={"model": train.ModelState(model)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.save(1, sync=True, raise_on_error=True)
    ckpt.close()
    repo = work / "repo"
    pipeline = pipeline or DLRM_PIPELINE
    export_checkpoint(str(work / "ckpt"), ExportOptions(repo=repo, name="dlrm", max_batch_size=64, pipeline=pipeline))
    rows = sample_rows(256, seed=1).reshape(-1)
    data = work / "dlrm-input.json"
    data.write_text(json.dumps({"data": [{"ROW": {"content": [r.decode()], "shape": [1]}} for r in rows]}))

    import onnxruntime as ort

    namespace: dict = {}
    exec(compile(PREPROCESS_MODEL_PY, "dlrm_preprocess", "exec"), namespace)  # noqa: S102 - the served text
    parse_rows = namespace["parse_rows"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    model_dir = "dlrm" if pipeline == "fused" else "dlrm_model"
    session = ort.InferenceSession(str(repo / model_dir / "1" / "model.onnx"), sess_options=options,
                                   providers=["CPUExecutionProvider"])

    def bare(batch: int, seconds: float) -> tuple[float, float]:
        done, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            start = done % (len(rows) - batch) if len(rows) > batch else 0
            dense, cats = parse_rows(rows[start:start + batch])
            session.run(["SCORE"], {"DENSE_RAW": dense, "CATEGORY_IDS": cats})
            done += batch
        return done / (time.perf_counter() - t0), (time.process_time() - c0) / done * 1e6

    return BenchModel(repo=repo, model="dlrm", input_data=data, shape_args=["--shape", "ROW:1"], bare=bare)


def _ort_session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def build_arrcoc(work: Path) -> BenchModel:
    """The ``arrcoc`` ensemble of examples/arrcoc (trained here, seeded: a few minutes), clients sending the
    shipped PNGs and their queries; Triton serves the example's own --triton-python copy."""
    sys.path.insert(0, str(ROOT / "examples" / "arrcoc"))
    import build_repository as arrcoc

    repo, triton_repo = work / "repo", work / "triton-repo"
    arrcoc.build(repo, also_triton_python=triton_repo, log=lambda *a, **k: None)
    images = ROOT / "examples" / "arrcoc" / "images"
    cases = json.loads((images / "queries.json").read_text())
    raws = [(images / c["image"]).read_bytes() for c in cases]
    data = work / "arrcoc-input.json"
    data.write_text(json.dumps({"data": [
        {"RAW_IMAGE": {"content": list(raw), "shape": [len(raw)]}, "TEXT_QUERY": {"content": [c["query"]], "shape": [1]}}
        for raw, c in zip(raws, cases)]}))

    sessions = {name: _ort_session(repo / name / "1" / "model.onnx")
                for name in ("texture_array", "propositional_scorer", "perspectival_scorer", "text_embedding",
                             "participatory_scorer", "decoder")}
    vocab = json.loads((repo / "query_tokenizer" / "1" / "vocab.json").read_text())
    words = json.loads((repo / "detokenizer" / "1" / "vocab.json").read_text())

    def run(name: str, out: str, **inputs: np.ndarray) -> np.ndarray:
        return sessions[name].run([out], inputs)[0]

    def bare(batch: int, seconds: float) -> tuple[float, float]:
        # every step of the ensemble, each on the whole batch, as dynamic batching would at best merge them
        done, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            picks = [(done + i) % len(cases) for i in range(batch)]
            image = np.stack([arrcoc.preprocessor.decode(raws[i]) for i in picks])
            ids = np.stack([arrcoc.tokenizer.tokenize(cases[i]["query"], vocab) for i in picks])
            texture = run("texture_array", "texture", image=image)
            embedding = run("text_embedding", "embedding", token_ids=ids)
            _, budget = arrcoc.opponent.opponent_process(
                run("propositional_scorer", "scores", texture=texture), run("perspectival_scorer", "scores", texture=texture),
                run("participatory_scorer", "scores", texture=texture, embedding=embedding))
            answer = run("decoder", "token_ids", texture=texture, token_budget=budget, embedding=embedding)
            [arrcoc.detokenizer.detokenize(row, words) for row in answer]
            done += batch
        return done / (time.perf_counter() - t0), (time.process_time() - c0) / done * 1e6

    return BenchModel(repo=repo, model="arrcoc", input_data=data, shape_args=[], bare=bare, triton_repo=triton_repo,
                      max_batch=arrcoc.MAX_BATCH_SIZE)


#: (name, builder) of every model measured
MODELS: list[tuple[str, Callable[[Path], BenchModel]]] = [("dlrm", build_dlrm), ("arrcoc", build_arrcoc)]


def perf(pa: Path, bm: BenchModel, protocol: str, port: int, c: int, measure_ms: int, work: Path,
         rows: int = 1) -> dict:
    """bench/serving.py's perf_analyzer run (bounded, measured again when unstable or stalled) for this model
    and its input data (``rows`` per request: perf_analyzer's -b; its Inferences/Second counts rows), and
    perf_analyzer's own CPU (its threads, once reaped): the client's share of the 2 cores, over every row it
    sent, as the server's is taken over every row it answered (a retry's too, on both sides)."""
    cpu0 = _children_cpu_s()
    r = base.perf_run(pa, bm.model, protocol, port, c, bm.input_data, measure_ms, work, batch=rows,
                      shape_args=bm.shape_args)
    if "error" not in r:
        r["client_cpu_s"] = _children_cpu_s() - cpu0
    return r


def _children_cpu_s() -> float:
    """User + system CPU of every child this process has reaped: the perf_analyzer runs (the servers, still
    running, are not reaped until the end)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def ceiling_vs_bare(bare_cpu_us_per_row: float, client_cpu_us_per_row: float, cores: int) -> float:
    """The best throughput any server could reach here over the bare loop's, as a ratio: the bare loop runs
    the model on one core with no client (its rows/s is 1e6 / its CPU per row); a served point shares
    ``cores`` with its client, so even a server whose only work were the model's (the bare loop's CPU per
    row) tops out at cores / (client CPU per row + bare CPU per row)."""
    if bare_cpu_us_per_row <= 0 or client_cpu_us_per_row < 0 or cores < 1:
        raise ValueError(f"CPU per row must be positive (bare {bare_cpu_us_per_row}, client "
                         f"{client_cpu_us_per_row}) and cores >= 1 ({cores})")
    return cores * bare_cpu_us_per_row / (client_cpu_us_per_row + bare_cpu_us_per_row)


def executions(http_port: int) -> dict[str, tuple[int, int]]:
    """(rows, executions) so far of every model a server has run, from its statistics (Triton's and ours)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/stats", timeout=30) as r:
        doc = json.loads(r.read())
    out: dict[str, tuple[int, int]] = {}
    for m in doc.get("model_stats", []):
        rows, runs = out.get(m["name"], (0, 0))
        out[m["name"]] = (rows + int(m.get("inference_count", 0)), runs + int(m.get("execution_count", 0)))
    return out


def batch_rows(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Rows per execution of each model between two ``executions`` readings: the batches the server's
    dynamic batchers really formed, to hold beside the bare limit's (an ensemble's: rows per request)."""
    out = {}
    for name, (rows, runs) in after.items():
        rows0, runs0 = before.get(name, (0, 0))
        if runs > runs0:
            out[name] = round((rows - rows0) / (runs - runs0), 1)
    return out


#: seconds of the bare loop run and thrown away before its first measured point: a process's first loop
#: over a fresh session runs slow (DLRM, 64-row batches: 6.0-8.3 us a row against 4.4-4.9 after, 2026-11-24),
#: which made ``--concurrency 32`` alone (the bare loop's only point, so also its first) read 0.75x bare over
#: HTTP (19:16 UTC, load 3.5-5.7: 124k rows/s against a cold 166k); warm, at 4.4-4.6 us a row, ~0.55x
BARE_WARMUP_S = 0.5


def bare_points(bare: Callable[[int, float], tuple[float, float]], concurrency: list[int], rows: int,
                max_batch: int, seconds: float) -> list[tuple[int, int, tuple[float, float]]]:
    """(c, batch rows, bare(batch, seconds)) for each concurrency c: the model on the largest batch dynamic
    batching could form from c requests of ``rows`` rows (at most ``max_batch``), after one warm-up run
    of :data:`BARE_WARMUP_S` on the first point's batch, not reported."""
    if not concurrency:
        return []
    batches = [min(c * rows, max_batch) for c in concurrency]
    bare(batches[0], BARE_WARMUP_S)
    return [(c, b, bare(b, seconds)) for c, b in zip(concurrency, batches)]


def measure(name: str, bm: BenchModel, bin_dir: Path, concurrency: list[int], measure_ms: int, work: Path,
            rows: int = 1) -> dict:
    from azulite.export.wrappers import python_backend_copy

    triton_repo = bm.triton_repo or python_backend_copy(bm.repo, work / f"{name}-triton-repo")
    figures: dict = {"triton": {}, "azulite": {}, "bare": {}}
    servers: dict = {}
    base.MODEL = bm.model  # wait_ready polls this model
    try:
        for server in ("triton", "azulite"):
            http_port, grpc_port, metrics_port = base.free_port(), base.free_port(), base.free_port()
            cmd = base.server_cmd(server, bin_dir, triton_repo if server == "triton" else bm.repo, http_port,
                                  grpc_port, metrics_port)
            print(f"starting {server} on {name} ...", flush=True)
            servers[server] = (base.start_server(f"{name}-{server}", cmd, http_port, work), http_port, grpc_port)
        for protocol in ("http", "grpc"):
            for c in concurrency:
                for server, (proc, http_port, grpc_port) in servers.items():
                    # the server's own CPU (its process tree: Triton's Python stubs too) per row it answered,
                    # from /proc and its statistics: a figure the machine's load stretches far less than
                    # throughput, and the one a server's own work is judged by
                    rows0, cpu0 = inference_count(http_port, bm.model), tree_cpu_s(proc.pid)
                    runs0 = executions(http_port)
                    r = perf(bin_dir / "perf_analyzer", bm, protocol, http_port if protocol == "http" else grpc_port,
                             c, measure_ms, work, rows)
                    served = inference_count(http_port, bm.model) - rows0
                    client_cpu_s = r.pop("client_cpu_s", None)
                    if "error" not in r and served > 0:
                        r["server_cpu_us_per_row"] = round((tree_cpu_s(proc.pid) - cpu0) / served * 1e6, 2)
                        r["client_cpu_us_per_row"] = round(client_cpu_s / served * 1e6, 2)
                        r["batch_rows"] = batch_rows(runs0, executions(http_port))
                    figures[server][f"{protocol}_c{c}"] = r
                    shown = (f"{r['infer_per_s']:>9.1f} rows/s  p50 {r['p50_ms']:7.3f} ms  p99 {r['p99_ms']:7.3f} ms"
                             + (f"  server CPU {r['server_cpu_us_per_row']:6.2f} us/row" if "server_cpu_us_per_row" in r
                                else "")
                             + (f"  client CPU {r['client_cpu_us_per_row']:6.2f} us/row" if "client_cpu_us_per_row" in r
                                else "")
                             + (f"  rows/execution {r['batch_rows']}" if r.get("batch_rows") else "")
                             + ("" if r["stable"] else "  (unstable: machine load)") if "error" not in r
                             else f"error: {r['error']}")
                    print(f"  {name} {server:8s} {protocol:4s} c={c:<3d} {shown}", flush=True)
    finally:
        for proc, _, _ in servers.values():
            base.stop(proc)
    # the limit at concurrency c: the model on the largest batch dynamic batching could form from c requests
    # of ``rows`` rows each (at most the ensemble's max_batch_size)
    figures["bare_cpu_us_per_row"] = {}
    for c, b, (per_s, cpu) in bare_points(bm.bare, concurrency, rows, bm.max_batch, measure_ms / 1000):
        figures["bare"][f"b{c}"], figures["bare_cpu_us_per_row"][f"b{c}"] = round(per_s, 1), round(cpu, 2)
        print(f"  {name} bare onnxruntime session, batches of {b:<3d} {per_s:>9.1f} rows/s  CPU {cpu:6.2f} us/row",
              flush=True)
    ratios: dict = {}
    for key, t in figures["triton"].items():
        a = figures["azulite"].get(key, {})
        if "error" in t or "error" in a:
            continue
        c = int(key.split("_c")[1])
        ratios[key] = {"vs_triton_throughput": round(a["infer_per_s"] / t["infer_per_s"], 3),
                       "vs_triton_p99": round(a["p99_ms"] / t["p99_ms"], 3),
                       "vs_bare_throughput": round(a["infer_per_s"] / figures["bare"][f"b{c}"], 3)}
        if "client_cpu_us_per_row" in a:
            # beside vs_bare_throughput: the most any server could reach at this point on this machine
            ratios[key]["ceiling_vs_bare"] = round(ceiling_vs_bare(
                figures["bare_cpu_us_per_row"][f"b{c}"], a["client_cpu_us_per_row"], CORES), 3)
        if "server_cpu_us_per_row" in a and "server_cpu_us_per_row" in t:  # below 1: less CPU per row than Triton
            ratios[key]["vs_triton_cpu_per_row"] = round(a["server_cpu_us_per_row"] / t["server_cpu_us_per_row"], 3)
        if "server_cpu_us_per_row" in a:
            # where the gap to the bare limit goes: the server's CPU per row over the bare loop's (the model and
            # its preprocessing alone, one thread); what is above 1 is the server's own work per row
            ratios[key]["vs_bare_cpu_per_row"] = round(a["server_cpu_us_per_row"]
                                                       / figures["bare_cpu_us_per_row"][f"b{c}"], 3)
    c_max = max(concurrency)
    goals = {
        "ge_1x_triton_every_point": bool(ratios) and all(r["vs_triton_throughput"] >= 1.0 for r in ratios.values()),
        f"ge_0.8x_bare_c{c_max}": all(ratios.get(f"{p}_c{c_max}", {}).get("vs_bare_throughput", 0) >= 0.8
                                       for p in ("http", "grpc")),
    }
    return {**figures, "ratio": ratios, "goals": goals}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--anchors", help="folder holding bin/tritonserver and bin/perf_analyzer")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--measure-ms", type=int, default=3000)
    ap.add_argument("--models", nargs="+", default=[n for n, _ in MODELS], help="which of MODELS to measure")
    ap.add_argument("--rows-per-request", type=int, default=1,
                    help="rows (images) in each request (perf_analyzer -b): a DLRM ranking request scores many "
                         "candidates at once")
    ap.add_argument("--dlrm-pipeline", choices=("fused", "ensemble"), default=DLRM_PIPELINE,
                    help="how the DLRM pipeline is exported (azulite export --pipeline)")
    args = ap.parse_args()
    sys.modules[__name__].DLRM_PIPELINE = args.dlrm_pipeline  # build_dlrm's default
    bin_dir = base.anchors(args.anchors)
    work = Path(tempfile.mkdtemp(prefix="azulite-bench-serve-models-"))
    results: dict = {}
    try:
        for name, builder in MODELS:
            if name not in args.models:
                continue
            print(f"== {name}: building its repository", flush=True)
            bm = builder(work / name)
            results[name] = measure(name, bm, bin_dir, args.concurrency, args.measure_ms, work, args.rows_per_request)
        print(json.dumps({"bench": "serve_models", "concurrency": args.concurrency, "rows_per_request": args.rows_per_request,
                          "dlrm_pipeline": args.dlrm_pipeline, "models": results}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
