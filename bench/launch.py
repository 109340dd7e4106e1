"""Launch overhead: azulite's local backend against torchrun started by hand (its anchor), in the same run,
same script (examples/ddp/train.py, 2 nodes x 2 processes, gloo on CPU), same rendezvous settings.

Three measures, as issue 16 names them:

- **start**: seconds from the submit command (``azulite job submit``, a fresh CLI process) or the first
  ``torchrun`` Popen to the first training step (rank 0's wall-clock stamp), and mean ms per step.
- **kill**: seconds from a ``kill -9`` of one training process (rank 3, on the second node) to the first
  training step after recovery (the group restarted by the elastic agent, ``--max-restarts``, every rank
  resumed from the last committed checkpoint) — checkpoints on local disk, and on Blob storage (Azurite)
  when Azurite is installed (``scripts/install.sh --dev``).
- **sweep**: wall seconds per trial of a grid sweep (``type: sweep``, one trial at a time) against running
  each trial's command alone with torchrun, so the difference is what the sweep machinery costs a trial;
  and where a trial's seconds go, for both (``sweep_trial_breakdown_s``, ``torchrun_trial_breakdown_s``).

Prints one JSON object as the last line.

    .venv/bin/python bench/launch.py [--steps 100] [--repeat 3] [--kills 2] [--trials 3] [--only start,kill,sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import psutil

from azulite.launch.local.procs import signal_all, tree

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples/ddp/train.py"
AZULITE = str(Path(sys.executable).parent / "azulite")
STEP = re.compile(rb"^step (\d+) loss \S+ step_s \S+ t (\S+)$", re.M)
# rank 0's first words after a (re)start; "starting fresh" when no checkpoint had committed before the kill
RESUMED = re.compile(rb"^(resumed from step \d+|no checkpoint: starting fresh)$", re.M)
ENV = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
KILLED_RANK = 3  # second node, second process: not the rendezvous host's, not rank 0 (which prints the stamps)


def stamps(text: bytes) -> list[tuple[int, float]]:
    return [(int(m.group(1)), float(m.group(2))) for m in STEP.finditer(text)]


def figures(t0: float, st: list[tuple[int, float]], steps: int) -> dict:
    assert len(st) == steps, f"saw {len(st)} of {steps} steps"
    return {"first_step_s": st[0][1] - t0, "per_step_ms": 1000 * (st[-1][1] - st[0][1]) / (steps - 1)}


def wait_until(pred: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if v := pred():
            return v
        time.sleep(0.02)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}")


def az(*args: str, env: dict) -> dict:
    out = subprocess.run([AZULITE, *args, "--json"], env=env, cwd=REPO, capture_output=True)
    if out.returncode:
        raise RuntimeError(f"azulite {' '.join(args)} exited {out.returncode}: {out.stderr.decode()[-2000:]}"
                           f"{out.stdout.decode()[-2000:]}")
    return json.loads(out.stdout)


def az_run(*args: str, env: dict) -> dict:
    """``azulite job submit ... --wait``: one process that follows the job in-process to its end, as a user
    waits for it. (Polling ``azulite job show`` instead started a CLI process every 0.25 s, each reading the
    job's MLflow metrics: a core's worth of load on the measured job, which it alone paid; under it a trial's
    exit-time metric write missed its deadline, and the sweep failed as "never logged the primary metric".)"""
    out = subprocess.run([AZULITE, "job", "submit", *args, "--wait", "--json"], env=env, cwd=REPO, capture_output=True)
    try:
        rec = json.loads(out.stdout)
    except ValueError:
        raise RuntimeError(f"azulite job submit {' '.join(args)} exited {out.returncode}: "
                           f"{out.stderr.decode()[-2000:]}") from None
    if rec["state"] != "succeeded":
        raise RuntimeError(f"{rec['id']} {rec['state']}: {rec['reason']} (see {rec['job_dir']})")
    return rec


def log_tail(logs: list[Path], n: int = 3000) -> str:
    return "\n".join(f"--- {p}:\n{p.read_bytes()[-n:].decode(errors='replace')}" for p in logs if p.exists())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nodes: int, per_node: int, args: list[str], workdir: Path, env: dict, *,
             max_restarts: int = 0) -> tuple[list[subprocess.Popen], list[Path]]:
    port = free_port()
    logs = [workdir / f"node-{n}-{port}.log" for n in range(nodes)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=bench-{port}",
             f"--rdzv-conf=is_host={int(n == 0)}", f"--max-restarts={max_restarts}", "--local-addr=127.0.0.1",
             str(TRAIN), *args],
            env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True,
        )
        for n, log in enumerate(logs)
    ]
    return procs, logs


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill the agents and their workers: torchrun starts each worker in a session of its own, so the
    agent's process group does not reach them; take the trees first (psutil), then kill."""
    everything = tree(p.pid for p in procs)
    signal_all(everything, signal.SIGKILL)
    psutil.wait_procs(everything, timeout=30)
    for p in procs:
        p.wait()


# ---- start: submit -> first step, time per step --------------------------------------------------------
def start_torchrun(steps: int, workdir: Path) -> dict:
    t0 = time.time()
    procs, logs = torchrun(2, 2, ["--steps", str(steps)], workdir, ENV)
    for p in procs:
        assert p.wait(timeout=600) == 0, f"torchrun failed:\n{log_tail(logs)}"
    return figures(t0, stamps(b"".join(log.read_bytes() for log in logs)), steps)


def start_azulite(steps: int, env: dict) -> dict:
    t0 = time.time()
    rec = az_run("examples/ddp/job.yaml", "--set", f"inputs.steps={steps}", "--set", "inputs.checkpoint_every=0",
                 env=env)
    log = Path(rec["job_dir"]) / "attempt-1" / "logs" / "rank-0.log"
    return figures(t0, stamps(log.read_bytes()), steps)


# ---- kill: kill -9 of a rank -> first step after recovery ----------------------------------------------
def rank0_started(roots: Callable[[], list[int]], since: float) -> float | None:
    """When the training process of rank 0 that started after ``since`` (the restarted one) began, by its
    process start time; None while there is none. A rank runner in front of it is not it."""
    for root in roots():
        try:
            kids = psutil.Process(root).children(recursive=True)
        except psutil.Error:
            continue
        for p in kids:
            try:
                if p.create_time() >= since - 0.02 and p.environ().get("RANK") == "0" and \
                        "azulite.launch.local.rank" not in (cmd := " ".join(p.cmdline())) and "train.py" in cmd:
                    return p.create_time()
            except psutil.Error:
                continue
    return None


def kill_and_time(rank0_log: Callable[[], Path | None], victim: Callable[[], int | None],
                  roots: Callable[[], list[int]]) -> dict:
    """Once rank 0 is 30 steps in (checkpoints every 10), SIGKILL the victim; seconds until rank 0's first
    step after its restart ("kill_to_step_s"), split at the start of rank 0's new process: "restart_s" (the
    failure noticed, the old group stopped, the rendezvous, the workers started) and "startup_s" (the
    script's imports, init_process_group, the restore, up to its first step)."""
    log = wait_until(lambda: (p := rank0_log()) and p.exists() and len(stamps(p.read_bytes())) >= 30 and p,
                     300, "30 steps before the kill")
    pid = wait_until(victim, 60, f"rank {KILLED_RANK}'s pid")
    offset = log.stat().st_size
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)

    def after() -> tuple[float, bool] | None:
        text = log.read_bytes()[offset:]
        restart = RESUMED.search(text)
        st = stamps(text[restart.end():]) if restart else []
        return (st[0][1] - t_kill, restart.group(1).startswith(b"resumed")) if st else None

    started = wait_until(lambda: rank0_started(roots, t_kill), 300, "rank 0's new process")
    seconds, resumed = wait_until(after, 300, "the first step after recovery")
    if not resumed:  # the restart found no committed checkpoint: this one measured no restore
        print("warning: no checkpoint had committed before the kill; the restart started fresh", file=sys.stderr)
    return {"kill_to_step_s": seconds, "restart_s": started - t_kill, "startup_s": seconds - (started - t_kill)}


def rank_pid_under(roots: list[int], rank: int) -> int | None:
    """The training process of ``rank`` among the descendants of ``roots`` (its RANK in its environment)."""
    for root in roots:
        try:
            for p in psutil.Process(root).children(recursive=True):
                try:
                    env = p.environ()
                    cmd = " ".join(p.cmdline())  # the script itself, not azulite's rank runner in front of it
                    if env.get("RANK") == str(rank) and "train.py" in cmd and "azulite.launch.local.rank" not in cmd:
                        return p.pid
                except psutil.Error:
                    continue
        except psutil.Error:
            continue
    return None


#: what torchrun's agent logs when a worker outlived the 30 s it is given to stop on SIGTERM at a restart
#: (LocalElasticAgent stops workers with a fixed 30 s grace): a kill-to-step time ~30 s above the others
HARD_STOP = re.compile(rb"forcefully exiting via")


def hard_stops(agent_logs: list[Path]) -> int:
    return sum(len(HARD_STOP.findall(p.read_bytes())) for p in agent_logs if p.exists())


def kill_torchrun(workdir: Path, ckpt: str, env: dict) -> dict:
    args = ["--steps", "100000", "--checkpoints", ckpt, "--checkpoint-every", "10", "--step-sleep", "0.02"]
    procs, logs = torchrun(2, 2, args, workdir, env, max_restarts=2)
    try:
        out = kill_and_time(lambda: logs[0], lambda: rank_pid_under([p.pid for p in procs], KILLED_RANK),
                            lambda: [p.pid for p in procs])
    finally:
        stop(procs)
    return {**out, "hard_stops": hard_stops(logs)}


def kill_azulite(ckpt: str | None, env: dict) -> dict:
    sets = ["--set", "inputs.steps=100000", "--set", "inputs.step_sleep=0.02", "--set", "inputs.checkpoint_every=10"]
    if ckpt:
        sets += ["--set", f"outputs.checkpoints.path={ckpt}"]
    job = az("job", "submit", "examples/ddp/job.yaml", *sets, env=env)
    log = Path(job["job_dir"]) / "attempt-1" / "logs" / "rank-0.log"
    try:
        # the agents' pids once, while the job starts; from then on the same psutil looks as for torchrun (a
        # `job show` beside the measured run costs it a CPU-second: it reads the job's checkpoints and metrics)
        agents = wait_until(lambda: len(a := [p["pid"] for p in az("job", "show", job["id"], env=env)["processes"]
                                              if p["kind"] == "agent"]) == 2 and a, 120, "the job's 2 agents")
        out = kill_and_time(lambda: log, lambda: rank_pid_under(agents, KILLED_RANK), lambda: agents)
    finally:
        az("job", "cancel", job["id"], env=env)
    return {**out, "hard_stops": hard_stops(sorted(log.parent.glob("node-*.log")))}


@contextmanager
def azurite(tmp: Path) -> Iterator[str | None]:
    """A connection string to a fresh Azurite, or None when it is not installed."""
    sys.path.insert(0, str(REPO))
    from tests.train.azurite import Azurite, azurite_binary  # the tests' own launcher (free port, temp dir)

    if azurite_binary() is None:
        yield None
        return
    server = Azurite(tmp / "azurite").start()
    try:
        yield server.connection_string
    finally:
        server.stop()


# ---- sweep: per trial, against the trial's command alone -----------------------------------------------
def sweep_yaml(lrs: list[float], steps: int) -> str:
    return f"""
type: sweep
name: bench-sweep
trial:
  code: {REPO / "examples" / "ddp"}
  command: >-
    python train.py --steps {steps} --lr ${{{{search_space.lr}}}} --checkpoint-every 0
  resources: {{instance_count: 1}}
  distribution: {{type: pytorch, process_count_per_instance: 2}}
  # the trial logs its one metric at its last step, so rank 0's MLflow writer first connects as the script
  # exits: the writer's exit waits for a connect in progress (train/metric_writer.py), nothing to set here
sampling_algorithm: grid
search_space:
  lr: {{type: choice, values: {json.dumps(lrs)}}}
objective: {{goal: minimize, primary_metric: loss}}
limits: {{max_total_trials: {len(lrs)}, max_concurrent_trials: 1}}
"""


def sweep_azulite(lrs: list[float], steps: int, workdir: Path, env: dict) -> tuple[float, list[dict]]:
    spec = workdir / "sweep.yaml"
    spec.write_text(sweep_yaml(lrs, steps))
    t0 = time.time()
    rec = az_run(str(spec), env=env)
    t_end = time.time()
    return t_end - t0, sweep_timeline(rec, t0, t_end, env)


def sweep_timeline(rec: dict, t0: float, t_end: float, env: dict) -> list[dict]:
    """Where each trial's seconds went, from the store's times, the rank records and rank 0's step stamps:
    ``submit_s`` (the previous trial's end, or the submit command's start for the first, to the trial's
    record: the CLI, the driver's start, the next trial's sampling and render), ``supervisor_s`` (to the
    supervisor's "running": its start, the job's folders, the MLflow store), ``agent_s`` (to the first rank
    runner: torchrun's agent, the rendezvous), ``to_first_step_s`` (the script's imports, init, the model),
    ``steps_s``, ``exit_s`` (rank 0's last step to the last rank's end: the process group's end, the
    metrics' exit drain), ``end_s`` (to the trial's recorded end: the agent's exit, the supervisor seeing it,
    outputs), and for the last trial ``wait_s`` (to the submit command's return: the driver's end, ``--wait``
    seeing it)."""
    from azulite.launch.local.store import JobStore
    from azulite.launch.local.sweeper import read_state
    from azulite.launch.settings import Settings

    store = JobStore(Settings.from_environ(env).db_path)
    out, prev_end = [], t0
    trials = read_state(rec["job_dir"])["trials"]
    for i, tr in enumerate(trials):
        job = store.get(tr["id"])
        jd = Path(job.job_dir)
        ranks = [json.loads(p.read_text()) for p in sorted(jd.glob("attempt-1/ranks/rank-*.json"))]
        st = stamps((jd / "attempt-1" / "logs" / "rank-0.log").read_bytes())
        first_rank = min(r["started_at"] for r in ranks)
        last_exit = max(r["ended_at"] for r in ranks)
        row = {"submit_s": job.created_at - prev_end, "supervisor_s": job.started_at - job.created_at,
               "agent_s": first_rank - job.started_at, "to_first_step_s": st[0][1] - first_rank,
               "steps_s": st[-1][1] - st[0][1], "exit_s": last_exit - st[-1][1], "end_s": job.ended_at - last_exit}
        if i == len(trials) - 1:
            row["wait_s"] = t_end - job.ended_at
        out.append(row)
        prev_end = job.ended_at
    return out


def sweep_torchrun(lrs: list[float], steps: int, workdir: Path) -> tuple[float, list[dict]]:
    t0 = time.time()
    out = []
    for lr in lrs:
        t_start = time.time()
        procs, logs = torchrun(1, 2, ["--steps", str(steps), "--lr", str(lr), "--checkpoint-every", "0"], workdir, ENV)
        assert procs[0].wait(timeout=600) == 0, f"torchrun failed:\n{log_tail(logs)}"
        t_exit = time.time()
        st = stamps(logs[0].read_bytes())
        out.append({"to_first_step_s": st[0][1] - t_start, "steps_s": st[-1][1] - st[0][1], "exit_s": t_exit - st[-1][1]})
    return time.time() - t0, out


def _mean_rows(rows: list[dict]) -> dict:
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: round(statistics.mean(r[k] for r in rows if k in r), 3) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100, help="steps per start run")
    ap.add_argument("--repeat", type=int, default=3, help="start runs per launcher")
    ap.add_argument("--kills", type=int, default=2, help="kill -9 runs per launcher and storage")
    ap.add_argument("--trials", type=int, default=3, help="sweep trials")
    ap.add_argument("--only", default="start,kill,sweep")
    args = ap.parse_args()
    parts = set(args.only.split(","))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still runs the clean-ups
    out: dict = {"bench": "launch", "ranks": 4, "cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)}
    med = statistics.median
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        env = {**os.environ, "AZULITE_HOME": str(tmp / "home")}
        if "start" in parts:
            res: dict[str, list[dict]] = {"azulite": [], "torchrun": []}
            for i in range(args.repeat):  # alternate, so background load hits both alike
                res["torchrun"].append(start_torchrun(args.steps, tmp))
                res["azulite"].append(start_azulite(args.steps, env))
                print(f"start {i}: torchrun {res['torchrun'][-1]}  azulite {res['azulite'][-1]}", file=sys.stderr)
            m = {k: {f: med(r[f] for r in v) for f in ("first_step_s", "per_step_ms")} for k, v in res.items()}
            out.update({
                "steps": args.steps, "repeat": args.repeat,
                "azulite_first_step_s": round(m["azulite"]["first_step_s"], 3),
                "torchrun_first_step_s": round(m["torchrun"]["first_step_s"], 3),
                "first_step_overhead_s": round(m["azulite"]["first_step_s"] - m["torchrun"]["first_step_s"], 3),
                "azulite_per_step_ms": round(m["azulite"]["per_step_ms"], 3),
                "torchrun_per_step_ms": round(m["torchrun"]["per_step_ms"], 3),
                "per_step_ratio": round(m["azulite"]["per_step_ms"] / m["torchrun"]["per_step_ms"], 3),
            })
        if "kill" in parts:
            with azurite(tmp) as conn:
                stores = {"local": None, **({"blob": conn} if conn else {})}
                out["kills"] = args.kills
                if not conn:
                    out["blob_skipped"] = "azurite-blob not installed (scripts/install.sh --dev)"
                for where, conn_str in stores.items():
                    kenv = {**env, **({"AZURE_STORAGE_CONNECTION_STRING": conn_str} if conn_str else {})}
                    k: dict[str, list[dict]] = {"azulite": [], "torchrun": []}
                    for i in range(args.kills):
                        ckpt = f"az://bench/k{i}" if conn_str else str(tmp / f"ckpt-{where}-{i}")
                        k["torchrun"].append(kill_torchrun(tmp, ckpt, {**ENV, **kenv}))
                        ckpt = f"az://bench/a{i}" if conn_str else None  # azulite: the job's own output folder
                        k["azulite"].append(kill_azulite(ckpt, kenv))
                        print(f"kill {where} {i}: torchrun {k['torchrun'][-1]}  azulite {k['azulite'][-1]}", file=sys.stderr)
                    m = {n: {f: med(r[f] for r in v) for f in ("kill_to_step_s", "restart_s", "startup_s")}
                         for n, v in k.items()}
                    a, t = m["azulite"]["kill_to_step_s"], m["torchrun"]["kill_to_step_s"]
                    out.update({f"azulite_kill_to_step_{where}_s": round(a, 3), f"torchrun_kill_to_step_{where}_s": round(t, 3),
                                f"kill_to_step_{where}_ratio": round(a / t, 3),
                                # every run, not only the median: an outlier is seen, and whether a worker
                                # outlived torchrun's 30 s stop grace in it (hard_stops)
                                f"kill_{where}_runs": {n: [{f: round(x, 3) if isinstance(x, float) else x
                                                            for f, x in r.items()} for r in v] for n, v in k.items()}})
                    for n in k:  # where the time goes: up to rank 0's new process, and from it to the step
                        out.update({f"{n}_kill_{where}_{f}": round(m[n][f], 3) for f in ("restart_s", "startup_s")})
        if "sweep" in parts:
            lrs = [0.01 * (i + 1) for i in range(args.trials)]
            t, t_rows = sweep_torchrun(lrs, 20, tmp)
            a, a_rows = sweep_azulite(lrs, 20, tmp, env)
            out.update({"trials": args.trials, "sweep_per_trial_s": round(a / args.trials, 3),
                        "torchrun_per_trial_s": round(t / args.trials, 3),
                        "sweep_overhead_per_trial_s": round((a - t) / args.trials, 3),
                        # where a trial's seconds go (means over the trials; sweep_timeline says what each is)
                        "sweep_trial_breakdown_s": _mean_rows(a_rows), "torchrun_trial_breakdown_s": _mean_rows(t_rows)})
    out["load_1m_end"] = round(os.getloadavg()[0], 2)  # figures taken under load are not claims
    print(json.dumps(out))


if __name__ == "__main__":
    main()
