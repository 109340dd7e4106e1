"""Launch overhead: azulite's local backend vs torchrun started by hand, same script (examples/ddp/train.py,
2 nodes x 2 processes, gloo on CPU), same rendezvous settings.

Measures, per run: seconds from the submit command (``azulite job submit``, a fresh CLI process) or the
first ``torchrun`` Popen to the first training step (rank 0's wall-clock stamp), and the mean seconds per
step over the steps (from the same stamps). Prints one JSON object as the last line.

    .venv/bin/python bench/launch.py [--steps 300] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP = re.compile(rb"^step (\d+) loss \S+ step_s \S+ t (\S+)$", re.M)


def stamps(text: bytes) -> list[tuple[int, float]]:
    return [(int(m.group(1)), float(m.group(2))) for m in STEP.finditer(text)]


def figures(t0: float, st: list[tuple[int, float]], steps: int) -> dict:
    assert len(st) == steps, f"saw {len(st)} of {steps} steps"
    return {"first_step_s": st[0][1] - t0, "per_step_ms": 1000 * (st[-1][1] - st[0][1]) / (steps - 1)}


def run_torchrun(steps: int, workdir: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    logs = [workdir / f"node-{n}.log" for n in range(2)]
    t0 = time.time()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=bench-{port}", "--local-addr=127.0.0.1",
             str(REPO / "examples/ddp/train.py"), "--steps", str(steps)],
            env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=workdir,
        )
        for log in logs
    ]
    for p in procs:
        assert p.wait(timeout=600) == 0, "torchrun failed"
    return figures(t0, stamps(b"".join(l.read_bytes() for l in logs)), steps)


def run_azulite(steps: int, home: Path) -> dict:
    env = {**os.environ, "AZULITE_HOME": str(home)}
    azulite = str(Path(sys.executable).parent / "azulite")
    t0 = time.time()
    out = subprocess.run([azulite, "job", "submit", "examples/ddp/job.yaml", "--set", f"inputs.steps={steps}",
                          "--set", "inputs.checkpoint_every=0", "--json"],
                         env=env, cwd=REPO, capture_output=True, check=True)
    job = json.loads(out.stdout)
    while True:
        rec = json.loads(subprocess.run([azulite, "job", "show", job["id"], "--json"], env=env, capture_output=True,
                                        check=True).stdout)
        if rec["state"] in ("succeeded", "failed", "canceled"):
            break
        time.sleep(0.5)
    assert rec["state"] == "succeeded", rec["reason"]
    log = Path(rec["job_dir"]) / "attempt-1" / "logs" / "rank-0.log"
    return figures(t0, stamps(log.read_bytes()), steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    res: dict[str, list[dict]] = {"azulite": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):  # alternate, so background load hits both alike
            res["torchrun"].append(run_torchrun(args.steps, Path(tmp)))
            res["azulite"].append(run_azulite(args.steps, Path(tmp) / "home"))
            print(f"run {i}: torchrun {res['torchrun'][-1]}  azulite {res['azulite'][-1]}", file=sys.stderr)
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("first_step_s", "per_step_ms")} for k, v in res.items()}
    print(json.dumps({
        "bench": "launch", "steps": args.steps, "repeat": args.repeat, "ranks": 4, "cpus": os.cpu_count(),
        "azulite_first_step_s": round(med["azulite"]["first_step_s"], 3),
        "torchrun_first_step_s": round(med["torchrun"]["first_step_s"], 3),
        "first_step_overhead_s": round(med["azulite"]["first_step_s"] - med["torchrun"]["first_step_s"], 3),
        "azulite_per_step_ms": round(med["azulite"]["per_step_ms"], 3),
        "torchrun_per_step_ms": round(med["torchrun"]["per_step_ms"], 3),
        "per_step_ratio": round(med["azulite"]["per_step_ms"] / med["torchrun"]["per_step_ms"], 3),
    }))


if __name__ == "__main__":
    main()
