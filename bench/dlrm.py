"""DLRM throughput: the azulite job (examples/dlrm through `azulite job submit`) vs a bare TorchRec loop
launched with plain torchrun (bench/dlrm_bare.py: same model, sharding constraints, optimizers, npy data
and batch size), measured in the same run; also 1 rank vs 2, the data readers alone (TSV and npy) against
what training consumes, and the AUC reached. Not a test. The last line printed is one JSON object.

    .venv/bin/python bench/dlrm.py [--rows 20000] [--batch_size 256]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = dict(num_embeddings=1000, embedding_dim=8, dense="32,8", over="32,1", lr=0.02, permille=100)


def reader_rows_per_s(path: Path, batch_size: int, world_size: int) -> float:
    """Global rows per second one rank's reader gets through (every rank walks every row)."""
    from azulite.data.criteo_reader import open_reader

    r = open_reader(path, rank=0, world_size=world_size, batch_size=batch_size,
                    num_embeddings_per_feature=[MODEL["num_embeddings"]] * 26, validation_permille=MODEL["permille"])
    t0, chunks = time.perf_counter(), 0
    while r.next_rows() is not None:
        chunks += 1
    return chunks * batch_size * world_size / (time.perf_counter() - t0)


def azulite_job(data: Path, home: Path, batch_size: int, nodes: int) -> dict:
    sets = {"inputs.dataset.path": str(data), "inputs.num_embeddings_per_feature": str(MODEL["num_embeddings"]),
            "inputs.embedding_dim": MODEL["embedding_dim"], "inputs.dense_arch_layer_sizes": MODEL["dense"],
            "inputs.over_arch_layer_sizes": MODEL["over"], "inputs.batch_size": batch_size,
            "inputs.learning_rate": MODEL["lr"], "inputs.epochs": 1,
            "inputs.validation_fraction": MODEL["permille"] / 1000, "instance_count": nodes,
            "resources.instance_count": nodes}
    args = [str(Path(sys.executable).parent / "azulite"), "job", "submit", "examples/dlrm/job.yaml", "--wait", "--json"]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    env = {**os.environ, "AZULITE_HOME": str(home)}
    p = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    job = json.loads(p.stdout)["id"]
    logs = subprocess.run([args[0], "job", "logs", job, "--rank", "0"], capture_output=True, text=True, env=env).stdout
    line = next(ln for ln in logs.splitlines() if ln.startswith("result "))
    return json.loads(line[len("result "):])


def bare_torchrun(data: Path, batch_size: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{port}", str(REPO / "bench/dlrm_bare.py"), "--dataset_path", str(data),
         "--batch_size", str(batch_size), "--num_embeddings", str(MODEL["num_embeddings"]),
         "--embedding_dim", str(MODEL["embedding_dim"]), "--dense_arch_layer_sizes", MODEL["dense"],
         "--over_arch_layer_sizes", MODEL["over"], "--learning_rate", str(MODEL["lr"]),
         "--validation_permille", str(MODEL["permille"])],
        capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return float(re.search(r"bare_samples_per_s=([\d.]+)", p.stdout).group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20000, help="rows per file (2 files)")
    ap.add_argument("--batch_size", type=int, default=256, help="per rank")
    args = ap.parse_args()
    from azulite.data.criteo_npy import convert
    from azulite.data.criteo_synth import generate

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-dlrm-") as tmp:
        tmp = Path(tmp)
        generate(tmp / "tsv", rows=args.rows, files=2, seed=0)
        convert(tmp / "tsv", tmp / "npy")
        out: dict = {"rows": 2 * args.rows, "batch_size_per_rank": args.batch_size}
        out["reader_tsv_rows_per_s"] = reader_rows_per_s(tmp / "tsv", args.batch_size, 2)
        out["reader_npy_rows_per_s"] = reader_rows_per_s(tmp / "npy", args.batch_size, 2)
        two = azulite_job(tmp / "npy", tmp / "home2", args.batch_size, nodes=2)
        print(f"azulite job, 2 ranks: {two}", flush=True)
        out["bare_samples_per_s"] = bare_torchrun(tmp / "npy", args.batch_size)
        print(f"bare TorchRec loop, 2 ranks: {out['bare_samples_per_s']:.0f} samples/s", flush=True)
        one = azulite_job(tmp / "npy", tmp / "home1", args.batch_size, nodes=1)
        print(f"azulite job, 1 rank: {one}", flush=True)
        tsv = azulite_job(tmp / "tsv", tmp / "home3", args.batch_size, nodes=2)
        print(f"azulite job, 2 ranks, TSV: {tsv}", flush=True)
    out.update({
        "azulite_samples_per_s": two["samples_per_s"],
        "ratio_vs_bare": two["samples_per_s"] / out["bare_samples_per_s"],
        "azulite_tsv_samples_per_s": tsv["samples_per_s"],
        "samples_per_s_1rank": one["samples_per_s"],
        "speedup_2_vs_1_rank": two["samples_per_s"] / one["samples_per_s"],
        "reader_tsv_over_consumption": out["reader_tsv_rows_per_s"] / tsv["samples_per_s"],
        "reader_npy_over_consumption": out["reader_npy_rows_per_s"] / two["samples_per_s"],
        "val_auc": two["val_auc"], "best_auc": two.get("best_auc"),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
    })
    print(json.dumps(out))


if __name__ == "__main__":
    main()
