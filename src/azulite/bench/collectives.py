"""Collective bandwidth with nccl-tests' semantics, run inside a job (one process per rank).

For each collective and each size S (bytes, nccl-tests' ``-b/-e/-f`` sweep) every rank runs ``warmup``
untimed and ``iters`` timed operations; the time is the mean per operation, averaged over the ranks
(as nccl-tests does), ``algbw = S / t`` and ``busbw = algbw * factor`` with nccl-tests' factors
(docs/PERFORMANCE.md of nccl-tests): 2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter and
alltoall (S the total buffer), 1 for broadcast. Every result is checked once per size against the value
each collective must produce (``#wrong`` counts wrong elements), on buffers apart from the timed ones so
timing never depends on the check.

Run as ``python -m azulite.bench.collectives --out DIR ...`` under torchrun (the launch backends do
that: ``azulite bench collectives``); rank 0 writes ``DIR/collectives.json``. gloo on CPU, nccl on GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from azulite.bench.nccl_tests import (  # noqa: F401 - re-exported: the per-rank program's API
    _ELEM, OPS, RESULT_FILE, Row, bus_factor, element_count, size_sweep, table,
)


# ---- one collective: (timed run on zero buffers, checked run on rank-valued buffers) -----------------
def _buffers(op: str, count: int, n: int, device: torch.device, fill: Callable[[int], torch.Tensor] | None):
    """(input, output) of ``op`` for an S-byte collective of ``count`` elements."""
    chunk = count // n if op in ("all_gather", "reduce_scatter", "alltoall") else count
    zeros = lambda k: torch.zeros(k, dtype=torch.float32, device=device)  # noqa: E731
    if op == "all_gather":
        return zeros(chunk), zeros(count)
    if op == "reduce_scatter":
        return zeros(count), zeros(chunk)
    if op == "alltoall":
        return zeros(count), zeros(count)
    return zeros(count), None  # all_reduce, broadcast: in place


def _run(op: str, inp: torch.Tensor, out: torch.Tensor | None) -> None:
    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, inp)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, inp)
    elif op == "alltoall":
        dist.all_to_all_single(out, inp)
    elif op == "broadcast":
        dist.broadcast(inp, src=0)
    else:
        raise ValueError(f"unknown collective {op!r}")


def check(op: str, count: int, rank: int, n: int, device: torch.device) -> int:
    """Run ``op`` once on inputs whose correct result is known in closed form; the number of wrong elements.
    Values are small integers, exact in float32."""
    inp, out = _buffers(op, count, n, device, None)
    chunk = count // n if out is not None else count
    if op == "all_reduce":
        inp.fill_(rank + 1)
        _run(op, inp, out)
        expect = torch.full_like(inp, n * (n + 1) / 2)
        got = inp
    elif op == "broadcast":
        inp.fill_(42.0 if rank == 0 else -1.0)
        _run(op, inp, out)
        expect, got = torch.full_like(inp, 42.0), inp
    elif op == "all_gather":
        inp.fill_(rank + 1)
        _run(op, inp, out)
        expect = torch.arange(1, n + 1, dtype=torch.float32, device=device).repeat_interleave(chunk)
        got = out
    elif op == "reduce_scatter":
        # chunk j of rank r holds (r+1)(j+1): rank r receives sum_r' (r'+1)(r+1) = (r+1) n(n+1)/2
        inp.copy_((rank + 1) * torch.arange(1, n + 1, dtype=torch.float32, device=device).repeat_interleave(chunk))
        _run(op, inp, out)
        expect = torch.full_like(out, (rank + 1) * n * (n + 1) / 2)
        got = out
    elif op == "alltoall":
        # chunk j of rank r holds r*n + j: rank r receives j*n + r from rank j
        inp.copy_((rank * n + torch.arange(n, dtype=torch.float32, device=device)).repeat_interleave(chunk))
        _run(op, inp, out)
        expect = (torch.arange(n, dtype=torch.float32, device=device) * n + rank).repeat_interleave(chunk)
        got = out
    else:
        raise ValueError(f"unknown collective {op!r}")
    return int((got != expect).sum().item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(op: str, size: int, *, iters: int, warmup: int, device: torch.device) -> Row:
    """One row of the table (every rank calls it; all get the same row)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    count = element_count(op, size, n)
    inp, out = _buffers(op, count, n, device, None)
    for _ in range(warmup):
        _run(op, inp, out)
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        _run(op, inp, out)
    _sync(device)
    per_op = (time.perf_counter() - t0) / iters
    # mean over ranks (nccl-tests), and the sum of wrong elements over ranks
    figures = torch.tensor([per_op, float(check(op, count, rank, n, device))], dtype=torch.float64, device=device)
    dist.all_reduce(figures)
    t = figures[0].item() / n
    wrong = int(figures[1].item())
    nbytes = count * _ELEM
    algbw = nbytes / 1e9 / t
    return Row(op=op, size=nbytes, count=count, time_us=t * 1e6, algbw=algbw, busbw=algbw * bus_factor(op, n),
               wrong=wrong, redop="sum" if op in ("all_reduce", "reduce_scatter") else "none",
               root=0 if op == "broadcast" else -1)


def memcopy_bandwidth(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Bytes copied per second by one ``copy_`` of ``nbytes`` (best of ``repeats``), in GB/s: the local
    limit a collective between processes of this machine works against."""
    src = torch.ones(max(nbytes // _ELEM, 1), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages outside the timing
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return src.numel() * _ELEM / 1e9 / best


def sweep(ops: list[str], sizes: list[int], *, iters: int, warmup: int, device: torch.device) -> list[Row]:
    return [measure(op, s, iters=iters, warmup=warmup, device=device) for op in ops for s in sizes]


# ---- the per-rank program ---------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m azulite.bench.collectives")
    p.add_argument("--out", required=True, help="folder rank 0 writes collectives.json into")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--min-bytes", type=int, default=1024)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--factor", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend)
    try:
        rows = sweep(a.ops.split(","), size_sweep(a.min_bytes, a.max_bytes, a.factor),
                     iters=a.iters, warmup=a.warmup, device=device)
        if dist.get_rank() == 0:
            result = {
                "world_size": dist.get_world_size(), "backend": backend, "device": str(device),
                "iters": a.iters, "warmup": a.warmup,
                "memcopy_gbps": memcopy_bandwidth(a.max_bytes, device),
                "rows": [asdict(r) for r in rows],
            }
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            tmp = out / (RESULT_FILE + ".tmp")
            tmp.write_text(json.dumps(result, indent=1))
            tmp.replace(out / RESULT_FILE)  # never a half-written result
            print(table(result["rows"], world_size=result["world_size"], backend=backend,
                        memcopy_gbps=result["memcopy_gbps"]), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
