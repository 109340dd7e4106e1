"""The DLRM loop's runtime report: what bench/dlrm.py compares between the job and the bare loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.launch.jobkit import REPO

_CHILD = """
import json, sys, threading
import torch
sys.setswitchinterval(0.002)
from azulite.workloads.dlrm.loop import runtime_settings
before = runtime_settings()
go = threading.Event()
t = threading.Thread(target=go.wait)
t.start()
mid = runtime_settings()
torch.set_num_threads(2)
after = runtime_settings()
go.set()
t.join()
print(json.dumps([before, mid, after]))
"""


def test_runtime_settings_report_the_thread_pools_switch_interval_affinity_threads_and_env():
    # a fresh interpreter: the settings are process-wide, and this one's must not leak into other tests
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", "AZULITE_TEST_UNRELATED": "x",
           "PYTHONPATH": str(REPO / "src")}
    p = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    before, mid, after = json.loads(p.stdout.strip().splitlines()[-1])
    assert before["torch_threads"] == 1 and after["torch_threads"] == 2  # from OMP_NUM_THREADS, then set
    assert before["torch_interop_threads"] >= 1
    assert before["switch_interval_s"] == 0.002
    assert before["affinity"] == sorted(os.sched_getaffinity(0))
    assert len(mid["threads"]) == len(before["threads"]) + 1  # the thread started between the two
    assert before["env"]["OMP_NUM_THREADS"] == "1" and before["env"]["MALLOC_ARENA_MAX"] == "2"
    assert "AZULITE_TEST_UNRELATED" not in before["env"]  # only what sets a rank's speed
