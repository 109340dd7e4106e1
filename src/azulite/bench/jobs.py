"""Run a bench program as a job through any launch backend: the collectives sweep is an ordinary command
job (``python -m azulite.bench.collectives``), so it runs across simulated nodes here and across real
nodes on a cluster with the same env contract and the same NCCL settings as training."""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from azulite.bench.nccl_tests import OPS, RESULT_FILE
from azulite.errors import BenchError, BenchInputError
from azulite.launch.backend import Backend
from azulite.spec.job import JobSpec, Output

RESULT_OUTPUT = "result"


def collectives_job(*, nodes: int, procs_per_node: int, ops: list[str], min_bytes: int, max_bytes: int,
                    factor: int, iters: int, warmup: int, code: str, python: str = sys.executable,
                    instance_type: str | None = None, timeout_s: float | None = None) -> JobSpec:
    """The job spec of one sweep. Bad arguments are refused here, before anything starts."""
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise BenchInputError(f"unknown collective(s): {', '.join(unknown)}", where="--ops",
                         fix=f"choose from {', '.join(OPS)}")
    if min_bytes < 4 or max_bytes < min_bytes:
        raise BenchInputError(f"size range {min_bytes}..{max_bytes} bytes is empty", where="--min-bytes/--max-bytes",
                         fix="e.g. --min-bytes 1K --max-bytes 64M (at least one float32)")
    if factor < 2:
        raise BenchInputError(f"step factor {factor} would never reach the largest size", where="--factor", fix="use 2 or more")
    if nodes < 1 or procs_per_node < 1 or nodes * procs_per_node < 2:
        raise BenchInputError(f"{nodes} node(s) x {procs_per_node} process(es) is fewer than 2 ranks: nothing to measure",
                         where="--nodes/--procs-per-node", fix="e.g. --nodes 2 --procs-per-node 2")
    if timeout_s is not None and timeout_s <= 0:
        raise BenchInputError(f"timeout {timeout_s:g} s is not positive", where="--timeout", fix="e.g. --timeout 1800")
    if iters < 1 or warmup < 0:
        raise BenchInputError("iters must be >= 1 and warmup >= 0", where="--iters/--warmup", fix="e.g. --iters 20 --warmup 5")
    command = " ".join([
        shlex.quote(python), "-m", "azulite.bench.collectives", "--out", "${{outputs.%s}}" % RESULT_OUTPUT,
        "--ops", ",".join(ops), "--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes),
        "--factor", str(factor), "--iters", str(iters), "--warmup", str(warmup),
    ])
    return JobSpec.model_validate({
        "name": "bench-collectives", "code": code, "command": command,
        "outputs": {RESULT_OUTPUT: {"type": "uri_folder"}},
        "resources": {"instance_count": nodes, **({"instance_type": instance_type} if instance_type else {})},
        "distribution": {"type": "pytorch", "process_count_per_instance": procs_per_node},
        "timeout": timeout_s,
    })


def run_collectives(backend: Backend, spec: JobSpec, *, poll_s: float = 0.3) -> tuple[str, dict]:
    """Submit the sweep, wait for it, return (job id, rank 0's result). A job that fails is a BenchError
    naming the job and the log to read."""
    rec = backend.submit(spec)
    while not rec.state.terminal:
        time.sleep(poll_s)
        rec = backend.status(rec.id)
    if rec.exit_code != 0 or rec.state.value != "succeeded":
        raise BenchError(f"the collectives job {rec.id} ended {rec.state.value} (exit {rec.exit_code}): {rec.reason or ''}".rstrip(": "),
                         where=rec.job_dir, fix=f"read `azulite job logs {rec.id}`")
    out = Output.model_validate(rec.spec["outputs"][RESULT_OUTPUT]).location(rec.job_dir, RESULT_OUTPUT)
    path = Path(out) / RESULT_FILE
    try:
        return rec.id, json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"job {rec.id} succeeded but wrote no readable result: {exc}", where=str(path),
                         fix=f"read `azulite job logs {rec.id} --rank 0`") from None


def empty_code_dir() -> tempfile.TemporaryDirectory:
    """The sweep needs no code of the user's: an empty folder to snapshot."""
    return tempfile.TemporaryDirectory(prefix="azulite-bench-")
