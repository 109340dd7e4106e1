"""Device-kit preflight (run by .devkit/setup.sh with the kit's venv python, from the repository root).

Checks, each timed, all failures listed at the end (exit 1 if any):
  imports    every package azulite serve / bench/serving.py --workers / tests/serve need, with versions
  servers    real Triton (the kit's bin/tritonserver, Python backend, 3.12 stub), azulite serve and
             azulite serve --workers 2, started at once on one small repository (bench_matmul + the bench's
             model gil_py with two instance processes, + string_py); each must answer
             /v2/health/ready; then bench_matmul over HTTP and gRPC must equal x @ W computed here
             (checks the stub's numpy); string_py (BYTES) on Triton is reported, not required
  perf       perf_analyzer --version, then 50 requests (count_windows) to bench_matmul on Triton and azulite
Usage: python .devkit/preflight.py TRITON_DIR   (source: scripts/device/preflight.py)
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # .devkit/preflight.py (build_kit.sh copies it there)
if not (ROOT / "tests/serve/models").is_dir():  # run from scripts/device/
    ROOT = Path(__file__).resolve().parents[2]
TD = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/triton")
FAIL: list[str] = []
WARN: list[str] = []
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"  [{time.monotonic() - T0:5.1f}s] {msg}", flush=True)


def fail(msg: str) -> None:
    FAIL.append(msg)
    say("FAIL " + msg)


# ---- imports ------------------------------------------------------------------------------------------
MODULES = ["azulite.serve.server", "azulite.cli", "numpy", "grpc", "google.protobuf", "pydantic", "pydantic_core",
           "typer", "rich", "yaml", "psutil", "prometheus_client", "threadpoolctl", "onnxruntime", "onnx",
           "httptools", "uvloop", "hpack", "orjson", "tritonclient.http", "tritonclient.grpc",
           "tritonclient.utils.shared_memory", "geventhttpclient", "gevent", "greenlet", "rapidjson", "ml_dtypes",
           "pytest", "pytest_timeout", "xdist", "matplotlib"]
OPTIONAL = ["torch", "cuda.bindings.runtime", "tritonclient.utils.cuda_shared_memory", "azulite.serve.cuda_shm"]
versions = {}
for name in MODULES + OPTIONAL:
    try:
        m = importlib.import_module(name)
        v = getattr(m, "__version__", "")
        where = str(Path(getattr(m, "__file__", "") or "?").parent)
        versions[name] = v
        if name in ("numpy", "grpc", "google.protobuf", "torch", "tritonclient.http", "pydantic", "onnxruntime",
                    "ml_dtypes", "gevent") or name.startswith("cuda"):
            say(f"import {name} {v}  ({where})")
    except Exception as exc:  # noqa: BLE001 - report every kind
        (fail if name in MODULES else WARN.append)(f"import {name}: {type(exc).__name__}: {exc}")
        if name in OPTIONAL:
            say(f"WARN import {name}: {type(exc).__name__}: {str(exc)[:160]}")
try:
    from azulite.serve import cuda_shm

    say(f"azulite.serve.cuda_shm.available() = {cuda_shm.available()}")
except Exception as exc:  # noqa: BLE001
    say(f"(azulite.serve.cuda_shm: {type(exc).__name__}: {str(exc)[:120]})")
say(f"imports done ({len(MODULES)} required, {len(OPTIONAL)} optional)")
if FAIL:
    print("KIT PREFLIGHT FAILED (imports):\n  " + "\n  ".join(FAIL), flush=True)
    sys.exit(1)

import numpy as np  # noqa: E402

# ---- servers ------------------------------------------------------------------------------------------
# the bench's own models (bench/serving_workers.py: gil_py, two instance processes; bench/serving.py's ports)
sys.path.insert(0, str(ROOT))
from bench.serving import free_port  # noqa: E402
from bench.serving_workers import GIL_CONFIG, GIL_PY, INSTANCE_PARAM  # noqa: E402


work = Path(tempfile.mkdtemp(prefix="kit-preflight-"))
repo = work / "repo"
for name in ("bench_matmul", "string_py"):
    (repo / name / "1").mkdir(parents=True)
    shutil.copy(ROOT / "tests/serve/models" / name / "config.pbtxt", repo / name / "config.pbtxt")
    shutil.copy(ROOT / "tests/serve/models" / name / "model.py", repo / name / "1" / "model.py")
(repo / "gil_py" / "1").mkdir(parents=True)
(repo / "gil_py" / "config.pbtxt").write_text(GIL_CONFIG + INSTANCE_PARAM.format("true"))
(repo / "gil_py" / "1" / "model.py").write_text(GIL_PY)

azulite = Path(sys.executable).parent / "azulite"  # where bench/serving.py's server_cmd looks
servers: dict[str, dict] = {}
for name in ("triton", "azulite_w1", "azulite_w2"):
    h, g, m = free_port(), free_port(), free_port()
    if name == "triton":
        cmd = [str(TD / "bin" / "tritonserver"), f"--model-repository={repo}", "--http-address=127.0.0.1",
               "--grpc-address=127.0.0.1", f"--http-port={h}", f"--grpc-port={g}", f"--metrics-port={m}"]
    else:
        cmd = [str(azulite), "serve", str(repo), "--http-port", str(h), "--grpc-port", str(g), "--metrics-port",
               str(m), "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1",
               "--workers", name[-1]]
    log = work / f"{name}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    servers[name] = {"proc": proc, "http": h, "grpc": g, "log": log, "t0": time.monotonic()}
say("started tritonserver, azulite serve, azulite serve --workers 2")


def tail(name: str, n: int = 1500) -> str:
    return servers[name]["log"].read_text(errors="replace")[-n:]


deadline = time.monotonic() + 90
pending = set(servers)
while pending and time.monotonic() < deadline:
    for name in sorted(pending):
        s = servers[name]
        if s["proc"].poll() is not None:
            fail(f"{name} exited {s['proc'].returncode} before ready; log tail:\n{tail(name)}")
            pending.discard(name)
            continue
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{s['http']}/v2/health/ready", timeout=2).status == 200:
                say(f"{name} ready in {time.monotonic() - s['t0']:.1f} s")
                s["ready"] = True
                pending.discard(name)
        except OSError:
            pass
    time.sleep(0.1)
for name in pending:
    fail(f"{name} not ready in 90 s; log tail:\n{tail(name)}")

W = ((np.arange(256 * 256, dtype=np.float32).reshape(256, 256) % 7) - 3.0) / 16.0
x = np.random.default_rng(0).uniform(-1, 1, (3, 256)).astype(np.float32)
want = x @ W
try:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    for name, s in servers.items():
        if not s.get("ready"):
            continue
        for proto, mod, port in (("http", httpclient, s["http"]), ("grpc", grpcclient, s["grpc"])):
            try:
                c = mod.InferenceServerClient(f"127.0.0.1:{port}")
                i = mod.InferInput("x", list(x.shape), "FP32")
                i.set_data_from_numpy(x)
                y = c.infer("bench_matmul", [i]).as_numpy("y")
                e = c.infer("gil_py", [i]).as_numpy("y")
                if not (np.allclose(y, want, rtol=1e-4, atol=1e-4) and np.array_equal(e, x)):
                    fail(f"{name} {proto}: bench_matmul/gil_py answered wrong values")
                t = mod.InferInput("TEXT", [1, 2], "BYTES")
                t.set_data_from_numpy(np.array([[b"ab", b"xyz"]], dtype=np.object_))
                try:
                    r = c.infer("string_py", [t])
                    ok = [v.decode() if isinstance(v, bytes) else v for v in r.as_numpy("UPPER").ravel()] == ["AB", "XYZ"]
                except Exception as exc:  # noqa: BLE001
                    ok = f"{type(exc).__name__}: {str(exc)[:200]}"
                if ok is not True:
                    (fail if name != "triton" else WARN.append)(f"{name} {proto}: string_py (BYTES) -> {ok}")
                    if name == "triton":
                        say(f"WARN {name} {proto}: string_py (BYTES) wrong or failed: {ok}")
            except Exception as exc:  # noqa: BLE001
                fail(f"{name} {proto} infer: {type(exc).__name__}: {str(exc)[:300]}")
    say("inference checks done (bench_matmul == x @ W, gil_py, string_py) over HTTP and gRPC")
except Exception as exc:  # noqa: BLE001
    fail(f"client: {type(exc).__name__}: {exc}")

# ---- perf_analyzer ------------------------------------------------------------------------------------
pa = TD / "bin" / "perf_analyzer"
p = subprocess.run([str(pa), "--version"], capture_output=True, text=True)
if p.returncode != 0:
    fail(f"perf_analyzer --version: exit {p.returncode}: {(p.stdout + p.stderr)[-400:]}")
else:
    say(f"perf_analyzer --version: {(p.stdout + p.stderr).strip().splitlines()[-1][:80]}")
    data = work / "input.json"
    data.write_text('{"data": [{"x": {"content": %s, "shape": [256]}}]}' % x[0].round(4).tolist())
    for name, proto in (("triton", "http"), ("azulite_w1", "grpc"), ("azulite_w2", "http")):
        s = servers[name]
        if not s.get("ready"):
            continue
        port = s["http"] if proto == "http" else s["grpc"]
        out = work / f"pa-{name}.csv"
        cmd = [str(pa), "-m", "bench_matmul", "-i", proto, "-u", f"127.0.0.1:{port}", "-b", "1", "--shape", "x:256",
               "--input-data", str(data), "--concurrency-range", "4", "--measurement-mode", "count_windows",
               "--measurement-request-count", "50", "--max-trials", "3", "--stability-percentage", "1000",
               "-f", str(out)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            if p.returncode == 0 and out.exists():
                row = out.read_text().splitlines()[1].split(",")
                say(f"perf_analyzer {proto} -> {name}: ok ({row[1]} infer/s)")
            else:
                fail(f"perf_analyzer {proto} -> {name}: exit {p.returncode}: {(p.stdout + p.stderr)[-400:]}")
        except subprocess.TimeoutExpired:
            fail(f"perf_analyzer {proto} -> {name}: no end in 60 s")

# ---- stop ---------------------------------------------------------------------------------------------
for name, s in servers.items():
    if s["proc"].poll() is None:
        s["proc"].send_signal(signal.SIGTERM)
for name, s in servers.items():
    try:
        s["proc"].wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(s["proc"].pid, signal.SIGKILL)
        s["proc"].wait(10)
        WARN.append(f"{name} did not stop on SIGTERM in 30 s (killed)")
if FAIL:
    keep = Path(tempfile.gettempdir()) / "kit-preflight-logs"
    shutil.rmtree(keep, ignore_errors=True)
    shutil.copytree(work, keep)
    say(f"server logs kept in {keep}")
shutil.rmtree(work, ignore_errors=True)
for w in WARN:
    print(f"  WARN {w}", flush=True)
if FAIL:
    print(f"KIT PREFLIGHT FAILED ({len(FAIL)}):\n  " + "\n  ".join(f.splitlines()[0] for f in FAIL), flush=True)
    sys.exit(1)
say("preflight OK")
