"""Where a DLRM step's CPU goes, per thread, in the azulite job's ranks and the bare loop's: a probe outside
the processes, run beside bench/dlrm.py's two sides. Not a test. The last line printed is one JSON object.

    .venv/bin/python bench/dlrm_probe.py [--rounds 3] [--variants job,script,bare] [--rows 120000]

Variants, run interleaved (round r runs them in order, rotated by r, so a drifting load favours none):

- ``job``: the azulite job, as bench/dlrm.py submits it (supervisor, torchrun agent, rank runners);
- ``script``: the same examples/dlrm/train.py and flags under plain torchrun, with the job's rank 0
  environment (its MLflow store included) but no supervisor and no rank runner: ``job`` vs ``script`` is
  the launcher's cost, ``script`` vs ``bare`` the script's;
- ``script-nolog``: ``script`` with ``--log_every 0`` (no progress lines, no MLflow values, no AUROC);
- ``script-nostop``: ``script`` with the preemption agreement once per 10**9 steps instead of every 10;
- ``bare``: bench/dlrm_bare.py under plain torchrun;
- ``bare-reader``: ``bare`` reading its batches with azulite's npy reader (memory-mapped, read ahead);
- ``bare-alt``: ``bare`` alternating blocks of 16 steps read from memory and through azulite's reader, each
  kind's CPU per step (main thread and process) reported apart: the reader's whole cost in the loop,
  its effect on the forward and backward included, in one process that meets one load;
- ``bare-altstop``: the same with blocks of 20 steps without and with the job's preemption agreement;
- ``bare-altnone``: the same alternation with no difference (an A/A: what the method reads by itself);
- ``bare-pg``: ``bare`` with a second, idle gloo process group, as the job's checkpointer makes (gloo's
  TCP loop thread of each group wakes every 10 ms, idle or not).

Over each side's own timed window (``window_unix`` in its result: the steps after ``--untimed_steps``) the
probe samples every thread of both ranks every ``--sample_s`` from ``/proc/PID/task/TID/sched`` (CPU time
in ns, scheduler switches voluntary and not, migrations between CPUs) and runs ``perf stat -I`` on each rank
(task-clock, context switches, CPU migrations, page faults; and cycles, instructions, cache misses where
the machine has hardware counters — a VM without a PMU says ``<not supported>``, reported as None). Figures
are per step: rates between the first and the last sample inside the window, times the window's seconds
per step. Thread names come from ``py-spy dump --nonblocking`` (CPython 3.11 names no OS thread). The rest
of each side's process tree (``azulite job submit --wait``, the supervisor, the torchrun agent, the rank
runners: every process carrying the run's ``AZULITE_PROBE_TAG``) is sampled too (``others``: CPU ms per
step by kind), since on 2 cores what they take the ranks lose.

A ``cpus_allowed`` change seen in a sample (e.g. ``0-1`` -> ``0`` -> ``0-1``) is the kernel pinning a thread
for a moment (``migrate_disable``, shown in /proc while it lasts), not an affinity anyone set: both sides
show it, and ``sched_getaffinity`` in each rank says 0-1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import dlrm as bench  # noqa: E402  (bench/dlrm.py: the job's flags, the bare loop's launch)
from server_procs import process_cpu_ns  # noqa: E402

_SCHED = re.compile(r"^(se\.sum_exec_runtime|se\.nr_migrations|nr_switches|nr_voluntary_switches|"
                    r"nr_involuntary_switches)\s*:\s*([\d.]+)", re.M)
PERF_EVENTS = "task-clock,context-switches,cpu-migrations,page-faults,cycles,instructions,cache-misses"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def find_ranks(tag: str, timeout: float = 300.0) -> dict[int, int]:
    """{rank: pid} of the two python processes whose environment holds ``AZULITE_PROBE_TAG=tag``."""
    want = f"AZULITE_PROBE_TAG={tag}".encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if want not in env or not (b"train.py" in cmd or b"dlrm_bare.py" in cmd) or b"azulite.launch" in cmd:
                continue
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[rank] = int(pid)
        if len(found) == 2:
            return found
        time.sleep(0.2)
    raise TimeoutError(f"no 2 ranks tagged {tag}")


def tagged(tag: str) -> dict[int, str]:
    """{pid: what it is} of every process carrying ``AZULITE_PROBE_TAG=tag`` (the side's whole tree)."""
    want = f"AZULITE_PROBE_TAG={tag}".encode()
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("perf "):  # the probe's own perf stat
            continue
        kind = ("azulite job submit --wait" if "job submit" in cmd
                else "torchrun agent" if "torch.distributed.run" in cmd or "torchrun" in cmd
                else "rank runner" if "azulite.launch.local.rank" in cmd
                else "rank" if ("train.py" in cmd or "dlrm_bare.py" in cmd)
                else "supervisor" if "supervis" in cmd else cmd[:60])
        out[int(pid)] = kind
    return out


def sample(pid: int) -> dict[int, list[float]]:
    """{tid: [cpu_ns, switches, voluntary, involuntary, migrations]} of every thread of ``pid``."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        text = _read(f"/proc/{pid}/task/{tid}/sched")
        if text is None:
            continue
        v = dict(_SCHED.findall(text))
        out[int(tid)] = [float(v.get("se.sum_exec_runtime", 0)) * 1e6, float(v.get("nr_switches", 0)),
                         float(v.get("nr_voluntary_switches", 0)), float(v.get("nr_involuntary_switches", 0)),
                         float(v.get("se.nr_migrations", 0))]
    return out


def thread_names(pid: int) -> dict[int, str]:
    """{tid: Python thread name} from py-spy (threads running no Python code: absent)."""
    spy = REPO / ".venv/bin/py-spy"
    p = subprocess.run([str(spy), "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                       timeout=30)
    names = {}
    for m in re.finditer(r'^Thread (0x[0-9A-Fa-f]+|\d+) \([^)]*\): "([^"]*)"', p.stdout, re.M):
        ident = m.group(1)
        names[int(ident, 16) if ident.startswith("0x") else int(ident)] = m.group(2)
    return names


class Watch:
    """Samples both ranks' threads until they exit; perf stat -I on each; py-spy names once mid-run."""

    def __init__(self, tag: str, sample_s: float) -> None:
        self.tag, self.sample_s = tag, sample_s
        self.samples: dict[int, list[tuple[float, dict]]] = {}
        self.names: dict[int, dict[int, str]] = {}
        self.comm: dict[int, dict[int, str]] = {}
        self.sched_info: dict[int, dict] = {}
        self.perf: dict[int, tuple[float, str]] = {}
        self.affinity: dict[int, dict[int, list[tuple[float, str]]]] = {}
        # the rest of the side's process tree (launcher, agent, rank runners): (time, {pid: (kind, cpu ns)})
        self.tree: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            ranks = find_ranks(self.tag)
            perfs = {}
            for rank, pid in ranks.items():
                self.samples[rank] = []
                f = tempfile.NamedTemporaryFile("w+", suffix=".perf", delete=False)  # noqa: SIM115
                t0 = time.time()
                perfs[rank] = (subprocess.Popen(["perf", "stat", "-x", ",", "-I", "200", "-e", PERF_EVENTS, "-p",
                                                 str(pid)], stdout=subprocess.DEVNULL, stderr=f), f, t0)
                status = _read(f"/proc/{pid}/status") or ""
                self.sched_info[rank] = {
                    "autogroup": (_read(f"/proc/{pid}/autogroup") or "").strip(),
                    "nice": int((_read(f"/proc/{pid}/stat") or "0 " * 20).rsplit(")", 1)[1].split()[16]),
                    "cpus_allowed": re.search(r"Cpus_allowed_list:\s*(\S+)", status).group(1),
                }
            named_at = time.monotonic() + 12.0  # past the setup: the training threads are up
            others, scanned = {}, 0.0
            while any(os.path.exists(f"/proc/{pid}") for pid in ranks.values()):
                now = time.time()
                if now - scanned > 1.0:  # a whole /proc scan: once a second
                    scanned = now
                    others = {p: k for p, k in tagged(self.tag).items() if p not in ranks.values()}
                self.tree.append((now, {p: (k, process_cpu_ns(p)) for p, k in others.items()}))
                for rank, pid in ranks.items():
                    s = sample(pid)
                    if s:
                        self.samples[rank].append((now, s))
                        # every thread's allowed CPUs, as (first seen, value) whenever it changes
                        for tid in s:
                            m = re.search(r"Cpus_allowed_list:\s*(\S+)", _read(f"/proc/{pid}/task/{tid}/status") or "")
                            seen = self.affinity.setdefault(rank, {}).setdefault(tid, [])
                            if m and (not seen or seen[-1][1] != m.group(1)):
                                seen.append((now, m.group(1)))
                        for tid in s:
                            self.comm.setdefault(rank, {}).setdefault(
                                tid, (_read(f"/proc/{pid}/task/{tid}/comm") or "?").strip())
                if time.monotonic() > named_at:
                    named_at = float("inf")
                    for rank, pid in ranks.items():
                        try:
                            self.names[rank] = thread_names(pid)
                        except (OSError, subprocess.SubprocessError):
                            self.names[rank] = {}
                time.sleep(self.sample_s)
            for rank, (proc, f, t0) in perfs.items():
                proc.wait(timeout=30)  # perf ends with the process it watches
                f.seek(0)
                self.perf[rank] = (t0, f.read())
                f.close()
                os.unlink(f.name)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e

    def figures(self, window: tuple[float, float], steps: int) -> dict:
        t0, t1 = window
        per_step_s = (t1 - t0) / steps
        out = {}
        for rank, samples in self.samples.items():
            inside = [(t, s) for t, s in samples if t0 <= t <= t1]
            if len(inside) < 2:
                out[rank] = {"error": f"{len(inside)} samples inside the window"}
                continue
            (ta, a), (tb, b) = inside[0], inside[-1]
            scale = per_step_s / (tb - ta)
            threads = {}
            for tid, vb in b.items():
                va = a.get(tid, [0.0] * 5)
                d = [(y - x) * scale for x, y in zip(va, vb)]
                name = self.names.get(rank, {}).get(tid) or self.comm.get(rank, {}).get(tid, "?")
                changes = [(round(t - t0, 2), v) for t, v in self.affinity.get(rank, {}).get(tid, [])]
                threads[f"{tid} {name}"] = {"cpu_ms": round(d[0] / 1e6, 4), "switches": round(d[1], 3),
                                            "cpus_allowed": changes,
                                            "voluntary": round(d[2], 3), "involuntary": round(d[3], 3),
                                            "migrations": round(d[4], 3), "new_in_window": tid not in a}
            total = {k: round(sum(t[k] for t in threads.values()), 4)
                     for k in ("cpu_ms", "switches", "voluntary", "involuntary", "migrations")}
            out[rank] = {"per_step": total, "threads": dict(sorted(threads.items(), key=lambda kv: -kv[1]["cpu_ms"])),
                         "sched": self.sched_info.get(rank), "perf_per_step": self._perf(rank, window, steps)}
        out["others"] = self._tree(window, steps)
        return out

    def _tree(self, window: tuple[float, float], steps: int) -> dict:
        """CPU ms per step of the side's other processes, by kind, over the window."""
        inside = [(t, s) for t, s in self.tree if window[0] <= t <= window[1]]
        if len(inside) < 2:
            return {}
        (ta, a), (tb, b) = inside[0], inside[-1]
        scale = (window[1] - window[0]) / steps / (tb - ta)
        per_kind: dict[str, float] = {}
        for pid, (kind, ns) in b.items():
            if pid in a:
                per_kind[kind] = per_kind.get(kind, 0.0) + (ns - a[pid][1]) * scale / 1e6
        return {k: round(v, 4) for k, v in sorted(per_kind.items())}

    def _perf(self, rank: int, window: tuple[float, float], steps: int) -> dict:
        if rank not in self.perf:
            return {}
        t_start, text = self.perf[rank]
        sums: dict[str, float | None] = {}
        first = last = None
        for line in text.splitlines():
            parts = line.split(",")
            if len(parts) < 4 or not re.match(r"^\s*[\d.]+$", parts[0]):
                continue
            t_end = t_start + float(parts[0])
            # intervals of 200 ms ending inside the window (the first starts up to 200 ms before it)
            if not window[0] + 0.2 <= t_end <= window[1]:
                continue
            first = t_end - 0.2 if first is None else first
            last = t_end
            event = parts[3]
            value = None if parts[1].startswith("<") else float(parts[1])
            sums[event] = None if value is None or sums.get(event, 0) is None else sums.get(event, 0) + value
        if first is None:
            return {}
        scale = (window[1] - window[0]) / steps / (last - first)
        return {k: (None if v is None else round(v * scale, 4)) for k, v in sums.items()}


def run_variant(name: str, data: Path, tmp: Path, args: argparse.Namespace, job_env: dict | None) -> dict:
    tag = uuid.uuid4().hex
    watch = Watch(tag, args.sample_s)
    os.environ["AZULITE_PROBE_TAG"] = tag
    watch.thread.start()
    try:
        if name == "job":
            result = bench.azulite_job(data, tmp / f"home-{tag}", args, 2, 0)
        elif name == "bare":
            result = bench.bare_torchrun(data, args)
        elif name == "bare-reader":
            result = bench.bare_torchrun(data, args, ("--probe_azulite_reader",))
        elif name == "bare-alt":
            result = bench.bare_torchrun(data, args, ("--probe_alternate_reader", "16"))
        elif name == "bare-altstop":
            result = bench.bare_torchrun(data, args, ("--probe_alternate_stop", "20"))
        elif name == "bare-altnone":
            result = bench.bare_torchrun(data, args, ("--probe_alternate_none", "20"))
        elif name == "bare-pg":
            result = bench.bare_torchrun(data, args, ("--probe_extra_gloo_group",))
        else:
            result = script_torchrun(name, data, tmp, args, job_env or {}, tag)
    finally:
        del os.environ["AZULITE_PROBE_TAG"]
    watch.thread.join(timeout=120)
    if watch.error is not None:
        raise watch.error
    steps = result["steps"] - args.untimed_steps
    return {"variant": name, "samples_per_s": result["samples_per_s"], "cpu_ms_per_step": result["cpu_ms_per_step"],
            "cpu_ms_per_step_ranks": result["cpu_ms_per_step_ranks"], "runtime": result.get("runtime"),
            "window_unix": result["window_unix"], "alternate_ms_per_step": result.get("alternate_ms_per_step"),
            "ranks": watch.figures(tuple(result["window_unix"]), steps)}


def script_torchrun(name: str, data: Path, tmp: Path, args: argparse.Namespace, job_env: dict, tag: str) -> dict:
    """examples/dlrm/train.py with the job's flags under plain torchrun, in the job's environment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = bench.MODEL
    flags = ["--dataset_path", str(data), "--num_embeddings_per_feature", str(m["num_embeddings"]),
             "--embedding_dim", str(m["embedding_dim"]), "--dense_arch_layer_sizes", m["dense"],
             "--over_arch_layer_sizes", m["over"], "--batch_size", str(args.batch_size),
             "--learning_rate", str(m["lr"]), "--epochs", "1", "--limit_train_batches", "0",
             "--validation_fraction", str(m["permille"] / 1000), "--checkpoints", str(tmp / f"ckpt-{tag}"),
             "--checkpoint_every", "0", "--log_every", "0" if name == "script-nolog" else str(args.log_every),
             "--step_sleep", "0", "--untimed_steps", str(args.untimed_steps), "--sharding_types", bench.SHARDING]
    if name == "script-nostop":
        flags += ["--stop_check_every", str(10**9)]
    # the job's variables that are its own (store, names), not the agent's or the rank's
    env = {k: v for k, v in job_env.items() if k.startswith(("AZULITE_", "AZUREML_", "MLFLOW_", "AZ_"))
           and k not in ("AZULITE_PROBE_TAG",)}
    env = {**os.environ, **env, "AZULITE_PROBE_TAG": tag, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{port}", str(REPO / "examples/dlrm/train.py"), *flags],
                       capture_output=True, text=True, env=env, timeout=900, start_new_session=True)
    assert p.returncode == 0, shlex.join(flags) + p.stdout[-2000:] + p.stderr[-2000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("result "))
    return json.loads(line[len("result "):])


def job_rank_env(tmp: Path, data: Path, args: argparse.Namespace) -> dict:
    """The environment of a job's rank 0 (read from /proc while a short job runs)."""
    tag = uuid.uuid4().hex
    os.environ["AZULITE_PROBE_TAG"] = tag
    env: dict = {}

    def grab() -> None:
        pid = find_ranks(tag)[0]
        with open(f"/proc/{pid}/environ", "rb") as f:
            env.update(dict(e.decode().split("=", 1) for e in f.read().split(b"\0") if b"=" in e))

    t = threading.Thread(target=grab, daemon=True)
    t.start()
    try:
        bench.azulite_job(data, tmp / "home-env", args, 2, 0)
    finally:
        del os.environ["AZULITE_PROBE_TAG"]
    t.join(timeout=60)
    return env


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=120000, help="rows per file (2 files)")
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--untimed_steps", type=int, default=20)
    ap.add_argument("--log_every", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="job,script,bare")
    ap.add_argument("--sample_s", type=float, default=0.2)
    ap.add_argument("--out", default=None, help="also write every run's full figures (per thread) here, as JSON")
    args = ap.parse_args()
    from azulite.data.criteo_npy import convert
    from azulite.data.criteo_synth import generate

    variants = args.variants.split(",")
    runs = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="probe-dlrm-") as tmp:
        tmp = Path(tmp)
        generate(tmp / "tsv", rows=args.rows, files=2, seed=0)
        convert(tmp / "tsv", tmp / "npy")
        job_env = job_rank_env(tmp, tmp / "npy", args) if any(v.startswith("script") for v in variants) else {}
        for r in range(args.rounds):
            for name in variants[r % len(variants):] + variants[: r % len(variants)]:
                run = run_variant(name, tmp / "npy", tmp, args, job_env)
                run["round"], run["loadavg"] = r, os.getloadavg()
                runs.append(run)
                print(json.dumps({k: run[k] for k in ("variant", "round", "samples_per_s", "cpu_ms_per_step",
                                                       "cpu_ms_per_step_ranks", "alternate_ms_per_step", "loadavg")}),
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))
    summary = {}
    for name in variants:
        mine = [r for r in runs if r["variant"] == name]
        s = {"cpu_ms_per_step_rank0": statistics.median(r["cpu_ms_per_step"] for r in mine),
             "samples_per_s": statistics.median(r["samples_per_s"] for r in mine)}
        alt = [r["alternate_ms_per_step"] for r in mine if r.get("alternate_ms_per_step")]
        if alt:  # rank 0's CPU per step with the probed difference minus without, per run: its cost
            probed = next(k for k in ("reader", "stop", "none") if k in alt[0])
            s[f"{probed}_minus_plain_ms_per_step"] = {
                k: [round(a[probed][k] - a["memory"][k], 4) for a in alt] for k in ("main_thread", "process")}
        others = [r["ranks"].get("others") or {} for r in mine]
        s["others_cpu_ms_per_step"] = {k: statistics.median(o.get(k, 0.0) for o in others)
                                       for k in sorted({k for o in others for k in o})}
        for rank in (0, 1):
            per = [r["ranks"].get(rank, {}).get("per_step") for r in mine]
            per = [p for p in per if p]
            if per:
                s[f"rank{rank}_probe_per_step"] = {k: statistics.median(p[k] for p in per) for k in per[0]}
            perf = [r["ranks"].get(rank, {}).get("perf_per_step") for r in mine]
            perf = [p for p in perf if p]
            if perf:
                s[f"rank{rank}_perf_per_step"] = {k: (None if any(p.get(k) is None for p in perf)
                                                      else statistics.median(p[k] for p in perf)) for k in perf[0]}
        summary[name] = s
    print(json.dumps({"variants": summary, "rounds": args.rounds, "loadavg_before": load_before,
                      "loadavg_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
