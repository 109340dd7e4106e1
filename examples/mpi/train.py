"""Data-parallel SGD with mpi4py, driven only by what mpirun sets (OMPI_COMM_WORLD_RANK / _SIZE / ...).

Each rank computes the gradient of a linear model on its own shard of a synthetic regression problem;
``Allreduce`` sums the gradients, so every rank takes the same step and all ranks end with the same
weights. The last line printed (by every rank) is ``final_params_sha256=<hex>``: the tests compare it
across ranks. numpy only, no framework: this is the MPI distribution's own shape (Horovod-style
allreduce), a few milliseconds per step.
"""

import argparse
import hashlib
import os
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=0.1)
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    print(f"rank {rank}/{size} local_rank {os.environ.get('OMPI_COMM_WORLD_LOCAL_RANK')} pid {os.getpid()} "
          f"mpi {MPI.Get_library_version().splitlines()[0].strip().rstrip(chr(0))}", flush=True)  # C string: NUL-ended

    true_w = np.random.default_rng(1).standard_normal(16)
    w = np.zeros(16)  # same start on every rank
    data = np.random.default_rng(100 + rank)  # each rank its own data shard
    grad_sum = np.empty_like(w)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x = data.standard_normal((args.batch_size, 16))
        err = x @ w - x @ true_w
        grad = 2.0 * x.T @ err / args.batch_size
        comm.Allreduce(grad, grad_sum, op=MPI.SUM)  # the data-parallel step: sum, then average
        w -= args.lr * grad_sum / size
        loss = comm.allreduce(float(np.mean(err**2)), op=MPI.SUM) / size
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step} loss {loss:.4e} step_s {time.perf_counter() - t0:.6f}", flush=True)

    comm.Barrier()
    print(f"final_params_sha256={hashlib.sha256(w.tobytes()).hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
