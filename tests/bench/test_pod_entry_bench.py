"""bench/pod_entry.py runs both sides for real and reports what its last line promises: the runs' wall
seconds each way, and the resident memory of the agent and a rank runner measured on the live processes
(a stdlib runner is a small fraction of a torch rank; the agent and runners are found by their command)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_measures_both_sides_and_the_live_processes():
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "pod_entry.py"), "--repeat", "1"], capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["procs"] == 2 and out["repeat"] == 1
    assert out["torchrun_s"] > 0 and out["pod_entry_s"] > 0
    assert abs(out["ratio"] - out["pod_entry_s"] / out["torchrun_s"]) < 0.002
    # a rank imports torch; its runner and the agent are the standard library only
    assert 0 < out["agent_rss_mib"] < out["rank_rss_mib"] / 4
    assert 0 < out["rank_runner_rss_mib"] < out["rank_rss_mib"] / 4
