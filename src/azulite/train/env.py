"""Start a training process from the distributed env contract, and nothing else.

The runtime never knows which backend started it (local torchrun, a Kubernetes Indexed Job, Azure ML):
it reads the variables all of them set — WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, and
torchrun's TORCHELASTIC_* when present — from an ``environ`` mapping passed in, so a test or a notebook
can hand it a plain dict.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import random
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from azulite import contract
from azulite.errors import LaunchError
from azulite.train.metrics import warm_up

Backend = Literal["auto", "gloo", "nccl"]


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(
            f"{name}={raw!r} is not an integer",
            where="environment",
            fix=f"start the script with torchrun or set {name} to an integer (e.g. {name}=0)",
        ) from None


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """The env contract as typed values (read once, at start)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    #: torchrun's agent hosts the rendezvous store (TORCHELASTIC_USE_AGENT_STORE=True).
    use_agent_store: bool = False
    #: torchrun's restart count: 0 on the first start, +1 per elastic restart of the group.
    restart_count: int = 0
    job_id: str | None = None
    #: 1-based attempt of the job (incremented by the launcher on each requeue after preemption).
    attempt: int = 1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> DistEnv:
        world_size = _int(environ, "WORLD_SIZE", 1)
        rank = _int(environ, "RANK", 0)
        if world_size < 1 or not 0 <= rank < world_size:
            raise LaunchError(
                f"RANK={rank} and WORLD_SIZE={world_size} are inconsistent",
                where="environment",
                fix="RANK must be in [0, WORLD_SIZE); start the script with torchrun",
            )
        if world_size > 1 and ("MASTER_ADDR" not in environ or "MASTER_PORT" not in environ):
            raise LaunchError(
                f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set",
                where="environment",
                fix="start the script with torchrun (or azulite job submit), which sets them",
            )
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=_int(environ, "LOCAL_RANK", 0),
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(environ, "MASTER_PORT", 29500),
            use_agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
            job_id=environ.get(contract.ENV_JOB_ID) or None,
            attempt=_int(environ, contract.ENV_ATTEMPT, 1),
        )


@dataclass(frozen=True, kw_only=True)
class TrainContext:
    """What a training script needs to know about where it runs."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when no process group was created (a single process)
    env: DistEnv

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def seed_everything(seed: int) -> None:
    """Seed torch, numpy's legacy global RNG and python's ``random`` (all three are checkpointed)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def enable_stack_dumps() -> bool:
    """Print every thread's Python stack to stderr (the rank's log) on :data:`contract.STACK_DUMP_SIGNAL`
    and go on: the rank runner and the supervisor send it to a rank that does not stop, so a hang shows
    where each rank and each of its threads was. Written by faulthandler from C, so it works while the main
    thread is stuck in a lock, a collective or a signal handler. A script's own handler for the signal is
    left alone (False)."""
    if signal.getsignal(contract.STACK_DUMP_SIGNAL) not in (signal.SIG_DFL, None):
        return False
    try:
        faulthandler.register(contract.STACK_DUMP_SIGNAL, all_threads=True, chain=False)
    except (ValueError, RuntimeError, OSError):  # no usable stderr (a closed or redirected-away fd 2)
        return False
    return True


_exit_hook = False


def skip_exit_collection() -> None:
    """Have the interpreter skip its cyclic garbage collection at exit (registered by :func:`init`).

    A process that has imported torch -- and torch._dynamo, which its optimizers import on their first
    use, and sympy with it -- tracks some 300,000 objects (0.25 s for one full collection here), and the
    collections Python runs while it finalises walk them over and over: 1.2-1.4 s of CPU at every exit of
    a rank here (0.2-0.3 s with this), paid
    again by each rank of a restarted or preempted group. ``gc.freeze()`` at exit moves what is alive to
    the permanent generation, which those collections skip; memory goes back to the system as the process
    ends either way. What it forgoes: ``__del__`` of objects that are only reachable from a reference
    cycle at exit, which Python does not promise to run anyway; azulite's own writers (checkpoints,
    metrics) are closed explicitly or by exit handlers, which run as before: what they allocate after the
    freeze is collected as usual."""
    global _exit_hook
    if not _exit_hook:
        _exit_hook = True
        atexit.register(gc.freeze)


def init(
    environ: Mapping[str, str] | None = None,
    *,
    backend: Backend = "auto",
    seed: int = 0,
    timeout: timedelta = timedelta(minutes=10),
) -> TrainContext:
    """Create the process group from the env contract, pick the device and seed the RNGs.

    ``backend="auto"`` is NCCL (with gloo for CPU tensors, which async checkpoints need) when CUDA is
    available, else gloo. A single process (WORLD_SIZE unset or 1) gets no process group at all.
    All ranks use the same ``seed``: models start identical, data differs through the sampler.
    """
    mapping = os.environ if environ is None else environ
    env = DistEnv.from_environ(mapping)
    enable_stack_dumps()
    skip_exit_collection()
    # rank 0's metrics writer starts connecting now, on its own thread: MLflow's import and the run's
    # creation overlap the rendezvous, the model's build and the restore instead of preceding the first step
    warm_up(mapping, wait=0)
    cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise LaunchError(
            "backend 'nccl' asked for but CUDA is not available",
            where="azulite.train.init",
            fix="use backend='gloo' (or 'auto') on CPU machines",
        )
    device = torch.device("cuda", env.local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    pg_backend: str | None = None
    if env.world_size > 1 and not dist.is_initialized():
        # Build the store ourselves instead of init_method="env://" so only the mapping above is read.
        # Under torchrun's agent store every rank is a client, one prefix per restart (as env:// does).
        store: dist.Store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            world_size=env.world_size,
            is_master=env.rank == 0 and not env.use_agent_store,
            timeout=timeout,
            multi_tenant=True,
        )
        if env.use_agent_store:
            store = dist.PrefixStore(f"/worker/attempt_{env.restart_count}", store)
        pg_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
        dist.init_process_group(
            pg_backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
        )
    elif dist.is_initialized():
        pg_backend = dist.get_backend()
    seed_everything(seed)
    return TrainContext(
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        device=device,
        backend=pg_backend,
        env=env,
    )


def shutdown(ctx: TrainContext) -> None:
    """Destroy the process group (if this process made one)."""
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()
