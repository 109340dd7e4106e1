"""Collective bandwidth: ``azulite bench collectives`` (a job on 2 simulated nodes x 2 ranks through the
local backend) vs the same all_reduce timed by a bare torch.distributed loop under one ``torchrun`` with
4 ranks, both gloo on loopback with the same settings, and vs the machine's memory-copy bandwidth.

Goal: azulite's busbw of all_reduce at 64 MB >= 0.95x the bare loop's (the harness adds nothing).
Prints one JSON object as the last line.

    .venv/bin/python bench/collectives.py [--size 64M] [--iters 10] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from azulite.bench.collectives import bus_factor, memcopy_bandwidth  # noqa: E402
from azulite.cli.bench import parse_size  # noqa: E402

RANKS = 4
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}

# the anchor: what anyone would write by hand, timed as nccl-tests times (mean per op, averaged over ranks)
BARE = textwrap.dedent("""
    import json, sys, time, torch, torch.distributed as dist
    size, iters, warmup = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    x = torch.zeros(size // 4, dtype=torch.float32)
    for _ in range(warmup):
        dist.all_reduce(x)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        print("RESULT", json.dumps({"time_s": t.item() / dist.get_world_size()}), flush=True)
    dist.destroy_process_group()
""")


def run_bare(size: int, iters: int, warmup: int, work: Path) -> float:
    script = work / "bare_allreduce.py"
    script.write_text(BARE)
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
         str(script), str(size), str(iters), str(warmup)],
        env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600, cwd=work)
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))
    t = json.loads(line.split(" ", 1)[1])["time_s"]
    return size / 1e9 / t * bus_factor("all_reduce", RANKS)


def run_azulite(size: int, iters: int, warmup: int, home: Path) -> float:
    env = {**os.environ, "AZULITE_HOME": str(home), "PYTHONPATH": str(REPO / "src")}
    p = subprocess.run(
        [str(Path(sys.executable).parent / "azulite"), "bench", "collectives", "--nodes", "2", "--procs-per-node", "2",
         "--ops", "all_reduce", "-b", str(size), "-e", str(size), "--iters", str(iters), "--warmup", str(warmup),
         "--json"], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    (row,) = json.loads(p.stdout)["rows"]
    assert row["wrong"] == 0
    return row["busbw"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="64M")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    size = parse_size(a.size, "--size")
    az, bare = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeat):  # alternate, so drift in the machine's load hits both alike
            az.append(run_azulite(size, a.iters, a.warmup, Path(tmp) / f"home-{i}"))
            bare.append(run_bare(size, a.iters, a.warmup, Path(tmp)))
            print(f"run {i}: azulite busbw {az[-1]:.3f} GB/s, bare loop {bare[-1]:.3f} GB/s", flush=True)
    memcpy = memcopy_bandwidth(size, torch.device("cpu"))
    az_m, bare_m = statistics.median(az), statistics.median(bare)
    print(json.dumps({
        "bench": "collectives", "op": "all_reduce", "size_bytes": size, "ranks": RANKS, "backend": "gloo",
        "azulite_busbw_gbps": round(az_m, 4), "bare_busbw_gbps": round(bare_m, 4),
        "ratio_vs_bare": round(az_m / bare_m, 3), "goal_ratio_vs_bare": 0.95,
        "memcopy_gbps": round(memcpy, 3), "ratio_vs_memcopy": round(az_m / memcpy, 4),
        "load_avg_1m": os.getloadavg()[0], "repeat": a.repeat,
    }))


if __name__ == "__main__":
    main()
