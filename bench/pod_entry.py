"""What the pod entry costs a pod: torchrun under ``pod_entry.py`` (agent + a rank runner per rank, as the
rendered AKS pods run it) against torchrun alone (its anchor), in the same run, alternating.

- **start-to-end**: wall seconds of a whole torchrun run of ``--nproc_per_node N`` ranks that each import
  torch and exit 0 (c10d rendezvous on loopback), median of ``--repeat`` runs each way;
- **memory**: resident MiB of the agent and of one rank runner while the ranks run (from /proc), beside
  torchrun's and one rank's own.

Prints one JSON object as the last line.

    .venv/bin/python bench/pod_entry.py [--repeat 7] [--procs 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from azulite.deploy import pod_entry
from azulite.launch.local.procs import free_port

ENTRY = pod_entry.__file__
BIN = str(Path(sys.executable).parent)
RANK = """
import sys, time
from pathlib import Path
import torch  # what a training rank pays first either way
if len(sys.argv) > 1:  # the memory run: stay until told
    Path(sys.argv[1], f"up-{__import__('os').environ['RANK']}").touch()
    while not Path(sys.argv[1], "go").exists():
        time.sleep(0.05)
"""


def argv(tmp: Path, procs: int, under_entry: bool, *script_args: str) -> list[str]:
    torchrun = [str(Path(BIN) / "torchrun"), "--nnodes=1", f"--nproc_per_node={procs}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--monitor_interval=0.1"]
    if not under_entry:
        return [*torchrun, str(tmp / "rank.py"), *script_args]
    return [sys.executable, ENTRY, "agent", "--marks", str(tmp / "marks"), "--", *torchrun, ENTRY, "rank", "--python",
            "--", str(tmp / "rank.py"), *script_args]


def timed(cmd: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def memory(tmp: Path, procs: int) -> dict[str, float]:
    """RSS (MiB) of the agent, torchrun, a rank runner and a rank, with every rank up."""
    flag = tmp / "flags"
    flag.mkdir()
    p = subprocess.Popen(argv(tmp, procs, True, str(flag)), cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while len(list(flag.glob("up-*"))) < procs and time.monotonic() < deadline:
        time.sleep(0.05)
    agent = psutil.Process(p.pid)
    (torchrun,) = agent.children()
    runners = torchrun.children()
    assert all(r.cmdline()[2:4] == [ENTRY, "rank"] for r in runners), [r.cmdline() for r in runners]
    ranks = [c for r in runners for c in r.children()]
    mib = 1024 * 1024
    out = {"agent_rss_mib": agent.memory_info().rss / mib, "torchrun_rss_mib": torchrun.memory_info().rss / mib,
           "rank_runner_rss_mib": statistics.mean(r.memory_info().rss for r in runners) / mib,
           "rank_rss_mib": statistics.mean(r.memory_info().rss for r in ranks) / mib}
    (flag / "go").touch()
    p.wait(timeout=300)
    return {k: round(v, 1) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--procs", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "rank.py").write_text(RANK)
        timed(argv(tmp, args.procs, False), tmp)  # warm the page cache: torch's import is most of a rank's start
        bare, entry = [], []
        for _ in range(args.repeat):  # alternating: drift on the machine lands on both sides
            bare.append(timed(argv(tmp, args.procs, False), tmp))
            entry.append(timed(argv(tmp, args.procs, True), tmp))
        mem = memory(tmp, args.procs)
    b, e = statistics.median(bare), statistics.median(entry)
    result = {"procs": args.procs, "repeat": args.repeat, "torchrun_s": round(b, 3), "pod_entry_s": round(e, 3),
              "overhead_s": round(e - b, 3), "ratio": round(e / b, 3), **mem}
    print(f"torchrun alone {b:.3f}s, under pod_entry {e:.3f}s (+{e - b:.3f}s); agent {mem['agent_rss_mib']} MiB, "
          f"rank runner {mem['rank_runner_rss_mib']} MiB beside torchrun's {mem['torchrun_rss_mib']} and a rank's "
          f"{mem['rank_rss_mib']} MiB")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
