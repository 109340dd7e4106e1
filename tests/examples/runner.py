"""Run an example through the real console script (``azulite job submit FILE --wait``) in an isolated
AZULITE_HOME (the ``home`` fixture of tests.launch.jobkit), and read back its ranks and logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.launch.jobkit import REPO

AZULITE = str(Path(sys.executable).parent / "azulite")  # the installed console script


def az(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([AZULITE, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "COLUMNS": "200"})


def run_example(name: str, *sets: str, timeout: float = 300) -> dict:
    """Submit examples/<name>/job.yaml with ``--set`` overrides, wait, and return ``job show --json``
    (with ``rank_logs``: rank -> log text) after asserting it succeeded."""
    args = ["job", "submit", f"examples/{name}/job.yaml", "--wait", "--json"]
    for s in sets:
        args += ["--set", s]
    p = az(*args, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    job_id = json.loads(p.stdout)["id"]
    show = az("job", "show", job_id, "--json")
    assert show.returncode == 0, show.stderr
    rec = json.loads(show.stdout)
    assert rec["state"] == "succeeded" and rec["exit_code"] == 0, rec
    ranks = [x for x in rec["processes"] if x["kind"] == "rank"]
    rec["rank_logs"] = {x["rank"]: Path(x["log"]).read_text() for x in ranks}
    return rec


def final_hashes(rec: dict) -> dict[int, str]:
    """rank -> the hex of its last line ``final_params_sha256=<hex>`` (asserts every rank printed it last)."""
    out = {}
    for rank, text in rec["rank_logs"].items():
        last = text.strip().splitlines()[-1]
        assert last.startswith("final_params_sha256="), (rank, text[-2000:])
        out[rank] = last.split("=", 1)[1]
    return out
