"""DLRM throughput: the azulite job (examples/dlrm through `azulite job submit`) vs a bare TorchRec loop
launched with plain torchrun (bench/dlrm_bare.py: same model, sharding plan, optimizers, npy data and batch
size), measured in the same run; also 1 rank vs 2, the data readers alone (TSV and npy) against what
training consumes, the cost of periodic checkpoints, and the AUC reached. Not a test. The last line
printed is one JSON object.

    .venv/bin/python bench/dlrm.py [--rows 120000] [--batch_size 256] [--pairs 1]

What is timed, on both sides alike: rank 0's clock from the end of training step ``--untimed_steps`` to the
end of the last training step; samples/s = the global samples of the steps in between over that time (one
pass over the training rows: ~420 steps of 2 x 256 with the defaults, ~5 s idle: long enough that the
job's once-a-second and once-per-5-s events land in every window alike, and a few slow steps weigh less
than in the ~210 steps of 60,000 rows per file this bench timed until round 22). Outside the window on
both sides: process start, imports, the process group, the planner and sharding, loading data (the bare loop reads
every array into memory first; azulite streams), the first steps' one-time costs, and after the last step
the held-out evaluation and the final checkpoint. Inside the window azulite does what its job does every
step: the streaming reader, the preemption agreement (an all-reduce every 10 steps), progress and MLflow
metrics every ``--log_every`` steps (rank 0's metrics thread writes the store in one transaction per 5 s
at most, ``azulite.train.metric_writer.WRITE_INTERVAL_S``: in the defaults' ~5 s window that is one, at
times two; a longer run pays ~8 ms of CPU per 5 s for it). Periodic async checkpoints are a choice of
interval, which the bare loop has no counterpart of: the head-to-head runs save only after the window (``--checkpoint_every 0``)
and one more 2-rank run saves every ``--ckpt_run_every`` steps (``checkpointing_samples_per_s``).

Both sides run as one node of 2 processes under one torchrun agent (the azulite job with
``instance_count=1, process_count_per_instance=2``; examples/dlrm/job.yaml's 2 simulated nodes x 1 would
add a second torchrun agent polling on this same machine, which real nodes do not share). The bench checks
that both got the same sharding plan (``table_wise`` for every table, asked of both), the same number of
steps and the same runtime settings (torch's intra- and inter-op threads, the switch interval, the CPU
affinity and the thread/allocator environment, as each side's rank 0 reports them; ``runtime`` in the JSON). ``cpu_ms_per_step`` (rank 0's process CPU time over the window, all threads) is printed beside each
figure: a shared, loaded machine blurs it less than the wall clock. ``--pairs N`` runs the azulite job and the
bare loop back to back N times, every other pair bare first (the ratio of each pair and their median;
``cpu_ratio_vs_bare``: the median of the pairs' ratios of rank 0's CPU per step, bare over azulite): on a
shared machine the spread says how far to trust one ratio.
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
#: one sharding type for both sides: the planner's pick among several turns on each side's storage estimate
#: (azulite's comes from this machine's available memory), and the two must run the same plan
SHARDING = "table_wise"
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


def azulite_job(data: Path, home: Path, args: argparse.Namespace, ranks: int, checkpoint_every: int) -> dict:
    sets = {"inputs.dataset.path": str(data), "inputs.num_embeddings_per_feature": str(MODEL["num_embeddings"]),
            "inputs.embedding_dim": MODEL["embedding_dim"], "inputs.dense_arch_layer_sizes": MODEL["dense"],
            "inputs.over_arch_layer_sizes": MODEL["over"], "inputs.batch_size": args.batch_size,
            "inputs.learning_rate": MODEL["lr"], "inputs.epochs": 1,
            "inputs.validation_fraction": MODEL["permille"] / 1000, "inputs.checkpoint_every": checkpoint_every,
            "inputs.log_every": args.log_every, "instance_count": 1, "resources.instance_count": 1,
            "distribution.process_count_per_instance": ranks}
    # --wait as a user runs it: its waiter looks at the job once a second and is woken by the job's end
    # (it looked every 0.3 s, ~8 ms of CPU per second the 2 ranks on 2 cores lost; fixed in the CLI)
    cmd = [str(Path(sys.executable).parent / "azulite"), "job", "submit", "examples/dlrm/job.yaml", "--wait", "--json"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    cmd += ["--set", f"command={_command_with_untimed(args.untimed_steps)}"]
    env = {**os.environ, "AZULITE_HOME": str(home)}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    wall = time.perf_counter() - t0
    job = json.loads(p.stdout)["id"]
    logs = subprocess.run([cmd[0], "job", "logs", job, "--rank", "0"], capture_output=True, text=True, env=env).stdout
    line = next(ln for ln in logs.splitlines() if ln.startswith("result "))
    return {**json.loads(line[len("result "):]), "wall_s": wall}


def runtime_differences(job: dict, bare: dict) -> dict:
    """The settings (``azulite.workloads.dlrm.loop.runtime_settings``) in which rank 0 of the job and of
    the bare loop differ, as {name: (job's, bare's)}; the threads alive are the job's own (its checkpoint
    group's gloo threads, rank 0's metrics writer) and are not compared."""
    out = {k: (job.get(k), bare.get(k)) for k in ("torch_threads", "torch_interop_threads", "switch_interval_s",
                                                   "affinity") if job.get(k) != bare.get(k)}
    env_j, env_b = job.get("env", {}), bare.get("env", {})
    out.update({f"env {k}": (env_j.get(k), env_b.get(k)) for k in sorted(set(env_j) | set(env_b))
                if env_j.get(k) != env_b.get(k) and k != "PYTHONPATH"})  # where imports come from: not speed
    return out


def _command_with_untimed(untimed: int) -> str:
    import yaml

    spec = yaml.safe_load((REPO / "examples/dlrm/job.yaml").read_text())
    return f"{spec['command'].strip()} --untimed_steps {untimed} --sharding_types {SHARDING}"


def bare_torchrun(data: Path, args: argparse.Namespace, extra: tuple[str, ...] = ()) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the variables the job's launcher sets that bear on a rank (azulite.launch.local): the same here
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{port}", str(REPO / "bench/dlrm_bare.py"), "--dataset_path", str(data),
         "--batch_size", str(args.batch_size), "--num_embeddings", str(MODEL["num_embeddings"]),
         "--embedding_dim", str(MODEL["embedding_dim"]), "--dense_arch_layer_sizes", MODEL["dense"],
         "--over_arch_layer_sizes", MODEL["over"], "--learning_rate", str(MODEL["lr"]),
         "--validation_permille", str(MODEL["permille"]), "--untimed_steps", str(args.untimed_steps),
         "--sharding_types", SHARDING, *extra],
        # its own session, as the azulite job's processes have (the supervisor detaches): with the kernel's
        # autogroup scheduling a busy machine shares CPU per session, and both sides must get the same share
        capture_output=True, text=True, env=env, timeout=900, start_new_session=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    m = re.search(r"bare_samples_per_s=([\d.]+) steps=(\d+) cpu_ms_per_step=([\d.]+) sharding=(\S+) "
                  r"cpu_ms_per_step_ranks=(\S+) minflt_per_step=([\d.]+)", p.stdout)
    return {"samples_per_s": float(m.group(1)), "steps": int(m.group(2)), "cpu_ms_per_step": float(m.group(3)),
            "sharding": json.loads(m.group(4)), "cpu_ms_per_step_ranks": json.loads(m.group(5)),
            "minflt_per_step": float(m.group(6)), "wall_s": time.perf_counter() - t0,
            **json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("bare_extra "))[len("bare_extra "):])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=120000, help="rows per file (2 files)")
    ap.add_argument("--batch_size", type=int, default=256, help="per rank")
    ap.add_argument("--untimed_steps", type=int, default=20, help="first steps outside the timed window (both sides)")
    ap.add_argument("--log_every", type=int, default=20, help="the azulite job's progress + MLflow interval")
    ap.add_argument("--checkpoint_every", type=int, default=0,
                    help="the azulite job's async checkpoint interval in the head-to-head runs (0: only the final "
                         "save, after the window); one more run measures checkpoints separately")
    ap.add_argument("--ckpt_run_every", type=int, default=50, help="checkpoint interval of the checkpointing run")
    ap.add_argument("--pairs", type=int, default=1, help="azulite / bare runs back to back, for the ratio's spread")
    args = ap.parse_args()
    from azulite.data.criteo_npy import convert
    from azulite.data.criteo_synth import generate

    load_before = os.getloadavg()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-dlrm-") as tmp:
        tmp = Path(tmp)
        generate(tmp / "tsv", rows=args.rows, files=2, seed=0)
        convert(tmp / "tsv", tmp / "npy")
        out: dict = {"rows": 2 * args.rows, "batch_size_per_rank": args.batch_size, "untimed_steps": args.untimed_steps}
        out["reader_tsv_rows_per_s"] = reader_rows_per_s(tmp / "tsv", args.batch_size, 2)
        out["reader_npy_rows_per_s"] = reader_rows_per_s(tmp / "npy", args.batch_size, 2)
        pairs = []
        for i in range(args.pairs):
            # every other pair runs the bare loop first: a machine whose load drifts during the bench then
            # favours neither side in the median
            if i % 2:
                bare = bare_torchrun(tmp / "npy", args)
                print(f"bare TorchRec loop, 2 ranks: {bare}", flush=True)
            two = azulite_job(tmp / "npy", tmp / f"home2-{i}", args, 2, args.checkpoint_every)
            print(f"azulite job, 2 ranks: {two}", flush=True)
            if not i % 2:
                bare = bare_torchrun(tmp / "npy", args)
                print(f"bare TorchRec loop, 2 ranks: {bare}", flush=True)
            assert two["sharding"] == bare["sharding"], (two["sharding"], bare["sharding"])
            assert two["steps"] == bare["steps"], (two["steps"], bare["steps"])
            # the two sides' thread pools, switch interval, affinity and thread/allocator env must match: a
            # difference there would be measured as azulite's cost or gain
            differ = runtime_differences(two["runtime"], bare["runtime"])
            assert not differ, f"the job and the bare loop ran under different settings: {differ}"
            pairs.append((two, bare))
        one = azulite_job(tmp / "npy", tmp / "home1", args, 1, args.checkpoint_every)
        print(f"azulite job, 1 rank: {one}", flush=True)
        tsv = azulite_job(tmp / "tsv", tmp / "home3", args, 2, args.checkpoint_every)
        print(f"azulite job, 2 ranks, TSV: {tsv}", flush=True)
        ckpt = azulite_job(tmp / "npy", tmp / "home4", args, 2, args.ckpt_run_every)
        print(f"azulite job, 2 ranks, checkpoint every {args.ckpt_run_every} steps: {ckpt}", flush=True)
    ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in pairs]
    # the same pairs by rank 0's CPU time per step (bare over azulite: < 1 means azulite costs more)
    cpu_ratios = [b["cpu_ms_per_step"] / a["cpu_ms_per_step"] for a, b in pairs]
    two_sps = statistics.median(a["samples_per_s"] for a, _ in pairs)
    out.update({
        "steps": pairs[0][0]["steps"], "sharding": pairs[0][0]["sharding"],
        "azulite_samples_per_s": two_sps,
        "bare_samples_per_s": statistics.median(b["samples_per_s"] for _, b in pairs),
        "ratio_vs_bare": statistics.median(ratios), "ratios": ratios,
        "cpu_ratio_vs_bare": statistics.median(cpu_ratios), "cpu_ratios": cpu_ratios,
        "azulite_cpu_ms_per_step": statistics.median(a["cpu_ms_per_step"] for a, _ in pairs),
        "bare_cpu_ms_per_step": statistics.median(b["cpu_ms_per_step"] for _, b in pairs),
        # minor page faults per step in the window (rank 0, all threads): allocator churn or mapped reads
        "azulite_minflt_per_step": statistics.median(a["minflt_per_step"] for a, _ in pairs),
        "bare_minflt_per_step": statistics.median(b["minflt_per_step"] for _, b in pairs),
        # every rank's CPU per step, per pair: a step waits for the slowest rank
        "azulite_cpu_ms_per_step_ranks": [a["cpu_ms_per_step_ranks"] for a, _ in pairs],
        "bare_cpu_ms_per_step_ranks": [b["cpu_ms_per_step_ranks"] for _, b in pairs],
        "checkpointing_samples_per_s": ckpt["samples_per_s"], "checkpoint_every": args.ckpt_run_every,
        "checkpointing_ratio_vs_bare": ckpt["samples_per_s"] / statistics.median(b["samples_per_s"] for _, b in pairs),
        "azulite_tsv_samples_per_s": tsv["samples_per_s"],
        "samples_per_s_1rank": one["samples_per_s"],
        "speedup_2_vs_1_rank": two_sps / one["samples_per_s"],
        "reader_tsv_over_consumption": out["reader_tsv_rows_per_s"] / tsv["samples_per_s"],
        "reader_npy_over_consumption": out["reader_npy_rows_per_s"] / two_sps,
        "runtime": {k: v for k, v in pairs[0][1]["runtime"].items() if k != "threads"},  # both sides' (checked)
        "val_auc": pairs[0][0]["val_auc"], "best_auc": pairs[0][0].get("best_auc"),
        "azulite_job_wall_s": pairs[0][0]["wall_s"], "bare_wall_s": pairs[0][1]["wall_s"],
        "bench_s": time.perf_counter() - t_start,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
    })
    print(json.dumps(out))


if __name__ == "__main__":
    main()
