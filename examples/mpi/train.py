"""Data-parallel SGD with mpi4py, driven only by what mpirun sets (OMPI_COMM_WORLD_RANK / _SIZE / ...).

Each rank computes the gradient of a linear model on its own shard of a synthetic regression problem;
``Allreduce`` sums the gradients, so every rank takes the same step and all ranks end with the same
weights. The last line printed (by every rank) is ``final_params_sha256=<hex>``: the tests compare it
across ranks and against a run that was preempted. numpy only, no framework: this is the MPI
distribution's own shape (Horovod-style allreduce), a few milliseconds per step.

Preemptible: with ``--state DIR`` (the job's ``outputs.state``) rank 0 saves the weights every
``--checkpoint-every`` steps (written whole, then renamed into place). On SIGTERM (a spot eviction,
``azulite job preempt``) each rank raises a flag; after every step an ``allreduce(MAX)`` of the flags makes
all ranks agree on the step to stop after, rank 0 saves that step, and every rank exits 75
(``EXIT_PREEMPTED``): the job is requeued and the next attempt resumes from the saved step. A step's data
come from a generator seeded by (rank, step), so a resumed run ends with the very weights of one that never
stopped.
"""

import argparse
import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

EXIT_PREEMPTED = 75  # azulite.contract.EXIT_PREEMPTED (EX_TEMPFAIL): "checkpointed, run me again"


class StopFlag:
    """Set by SIGTERM: a plain attribute (the handler takes no lock, so a second signal cannot deadlock it)."""

    def __init__(self) -> None:
        self.raised = False
        signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, *_: object) -> None:
        self.raised = True


def save(state: Path, step: int, w: np.ndarray) -> None:
    """Rank 0 writes the step's weights whole, then renames them into place (a crash leaves the last one)."""
    tmp = state / f"weights.npz.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.savez(f, step=step, w=w)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, state / "weights.npz")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--state", default="", help="folder for the weights (preemptible when set)")
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (to preempt a tiny run mid-way)")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    print(f"rank {rank}/{size} local_rank {os.environ.get('OMPI_COMM_WORLD_LOCAL_RANK')} pid {os.getpid()} "
          f"mpi {MPI.Get_library_version().splitlines()[0].strip().rstrip(chr(0))}", flush=True)  # C string: NUL-ended
    stop = StopFlag()
    state = Path(args.state) if args.state else None
    if state is not None:
        state.mkdir(parents=True, exist_ok=True)

    true_w = np.random.default_rng(1).standard_normal(16)
    w = np.zeros(16)  # same start on every rank
    start = 0
    if state is not None and (state / "weights.npz").exists():
        with np.load(state / "weights.npz") as saved:  # every rank reads the same file
            start, w = int(saved["step"]), saved["w"].copy()
        print(f"resumed from step {start}", flush=True)
    grad_sum = np.empty_like(w)
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        x = np.random.default_rng([100 + rank, step]).standard_normal((args.batch_size, 16))  # rank's shard
        err = x @ w - x @ true_w
        grad = 2.0 * x.T @ err / args.batch_size
        comm.Allreduce(grad, grad_sum, op=MPI.SUM)  # the data-parallel step: sum, then average
        w -= args.lr * grad_sum / size
        loss = comm.allreduce(float(np.mean(err**2)), op=MPI.SUM) / size
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step} loss {loss:.4e} step_s {time.perf_counter() - t0:.6f}", flush=True)
        time.sleep(args.step_sleep)
        stopping = comm.allreduce(int(stop.raised), op=MPI.MAX) > 0  # one decision, the same step everywhere
        if state is not None and (stopping or step % args.checkpoint_every == 0):
            if rank == 0:
                save(state, step, w)
                print(f"checkpoint: step {step} saved", flush=True)
            comm.Barrier()  # nobody exits before the save is in place
        if stopping and state is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a later notice must not turn this 75 into 143
            print(f"preempted after step {step}: exiting {EXIT_PREEMPTED}", flush=True)
            sys.exit(EXIT_PREEMPTED)

    comm.Barrier()
    print(f"final_params_sha256={hashlib.sha256(w.tobytes()).hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
