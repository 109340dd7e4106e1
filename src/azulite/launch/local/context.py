"""An attempt's launch context (its directories, substituted command and base environment) and the
processes of a job, found by the mark every one of them carries in its environment.

Built by the supervisor for each attempt and by the backend for a preflight; the strategies
(``strategy.py``) start processes from it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from azulite.contract import ENV_ATTEMPT, ENV_JOB_ID
from azulite.errors import LaunchError
from azulite.launch.data import output_location
from azulite.launch.local.procs import ENV_JOB_DIR
from azulite.launch.local.strategy import LaunchContext
from azulite.launch.tracking import tracking_env
from azulite.spec.job import JobSpec, PathInput
from azulite.spec.loader import render_command

#: inherited variables that would confuse the rank identity of the job's processes
_STRIP_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TF_CONFIG", "AZULITE_RANK", "AZULITE_LOCAL_RANK", "AZULITE_NODE_RANK", ENV_JOB_ID, ENV_ATTEMPT,
    "AZULITE_JOB_DIR",
)


def visible_gpus(environ: dict[str, str]) -> tuple[str, ...]:
    """GPU ids this machine offers: CUDA_VISIBLE_DEVICES if set, else ``nvidia-smi -L``; () on CPU."""
    if environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return tuple(x.strip() for x in environ["CUDA_VISIBLE_DEVICES"].split(",") if x.strip())
    if not shutil.which("nvidia-smi"):
        return ()
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU ")))


def rdzv_port(spec: JobSpec) -> int | None:
    """The c10d rendezvous port a pytorch job pins with ``environment_variables.MASTER_PORT`` (torchrun's
    ``--rdzv-endpoint``; its workers' MASTER_PORT is torchrun's own store, which torchrun sets); None for
    another job, whose MASTER_PORT is a variable like any other."""
    raw = spec.environment_variables.get("MASTER_PORT")
    if raw is None or spec.distribution_type != "pytorch":
        return None
    try:
        port = int(raw)
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        raise LaunchError(
            f"MASTER_PORT {raw!r} is not a TCP port", where="environment_variables.MASTER_PORT",
            fix="use a number between 1024 and 65535, or remove it to let azulite choose",
        ) from None
    return port


def build_context(job_id: str, attempt: int, spec: JobSpec, job_dir: Path, environ: dict[str, str],
                  *, python: str = sys.executable, make_dirs: bool = True,
                  inputs: dict[str, str] | None = None) -> LaunchContext:
    """The per-attempt context: directories, substituted command, base environment. ``inputs`` maps
    remote inputs to their local copies (``data.fetch_inputs``); others are handed over as written."""
    outputs = {}
    for name, out in spec.outputs.items():
        path = output_location(name, out, job_dir)
        if make_dirs and "://" not in path:
            (Path(path) if out.type == "uri_folder" else Path(path).parent).mkdir(parents=True, exist_ok=True)
        outputs[name] = path
    local_inputs = {n: (v.model_copy(update={"path": inputs[n]}) if isinstance(v, PathInput) and n in (inputs or {}) else v)
                    for n, v in spec.inputs.items()}
    attempt_dir = job_dir / f"attempt-{attempt}"
    node_dirs = tuple(job_dir / "nodes" / f"node-{k}" for k in range(spec.nodes))
    if make_dirs:
        snapshot = job_dir / "code"
        for d in node_dirs:
            if not d.exists():
                shutil.copytree(snapshot, d, symlinks=True)
        (attempt_dir / "logs").mkdir(parents=True, exist_ok=True)
        (attempt_dir / "ranks").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in environ.items() if k not in _STRIP_ENV and not k.startswith("TORCHELASTIC_")}
    # this interpreter's bin first, once (the submitting shell's PATH often has it already)
    parts = [str(Path(python).parent), *env.get("PATH", "/usr/bin:/bin").split(os.pathsep)]
    env["PATH"] = os.pathsep.join(dict.fromkeys(p for p in parts if p))
    env.update(tracking_env(spec, job_dir))  # the job's MLflow store, unless its spec names another
    env.update(spec.environment_variables)
    if spec.distribution_type == "pytorch":  # a pinned rendezvous port, handed to the strategy instead
        env.pop("MASTER_PORT", None)
    env.update({ENV_JOB_ID: job_id, ENV_ATTEMPT: str(attempt), ENV_JOB_DIR: str(job_dir), "PYTHONUNBUFFERED": "1"})
    env.update({f"AZULITE_OUTPUT_{n.upper()}": p for n, p in outputs.items()})
    # the names Azure ML gives a command job's data (AZURE_ML_INPUT_<name>, AZURE_ML_OUTPUT_<name>)
    env.update({f"AZURE_ML_INPUT_{n}": v.path for n, v in local_inputs.items() if isinstance(v, PathInput)})
    env.update({f"AZURE_ML_OUTPUT_{n}": p for n, p in outputs.items()})
    return LaunchContext(
        job_id=job_id, attempt=attempt, spec=spec,
        command=render_command(spec.command, local_inputs, outputs),
        python=python, attempt_dir=attempt_dir, node_dirs=node_dirs, base_env=env,
        rdzv_port=rdzv_port(spec), gpus=visible_gpus(environ),
    )
