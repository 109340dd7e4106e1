"""``azulite doctor``: the node health check as a pass/warn/fail/skipped table (or ``--json``); exit 1 when
any check fails, so it can gate a training pod as an init container."""

from __future__ import annotations

import json
import os
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from azulite.bench.doctor import Expectations, failed, run_checks, to_json
from azulite.errors import AzuliteError

_STYLE = {"pass": "bold green", "warn": "yellow", "fail": "bold red", "skipped": "dim"}


def doctor(
    sku: Optional[str] = typer.Option(None, "--sku", help="This node's VM size in the catalog (e.g. ND96asr_v4): its GPU count and InfiniBand are expected; --gpus / --infiniband override."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=0, help="GPUs this node's SKU has (e.g. 8 for ND96asr_v4)."),
    infiniband: Optional[bool] = typer.Option(None, "--infiniband/--no-infiniband", help="Whether the SKU has InfiniBand."),
    matmul_tflops: Optional[float] = typer.Option(None, "--matmul-tflops", help="SKU's dense bf16 TFLOP/s per GPU."),
    gpu_mem_gbps: Optional[float] = typer.Option(None, "--gpu-mem-gbps", help="SKU's GPU memory bandwidth, GB/s."),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="Checkpoint location to test writing to (DIR or az://container/dir)."),
    min_write_gbps: float = typer.Option(0.1, "--min-write-gbps", min=0.0, help="Warn below this checkpoint write bandwidth."),
    json_: bool = typer.Option(False, "--json", help="Print the checks as JSON."),
) -> None:
    """Check this node before training: GPUs visible vs the SKU, ECC errors, driver/CUDA, NCCL/InfiniBand,
    matmul TFLOP/s and memory bandwidth probes, checkpoint write bandwidth, free /dev/shm, clock throttling.
    What cannot be checked here (no GPU) is skipped with the reason. Exits 1 if any check fails.

      azulite doctor --sku ND96asr_v4 --checkpoint az://checkpoints/run1

      azulite doctor --gpus 8 --infiniband --checkpoint az://checkpoints/run1

      azulite doctor --json | jq .ok
    """
    for flag, value, example in (("--matmul-tflops", matmul_tflops, 312), ("--gpu-mem-gbps", gpu_mem_gbps, 2039)):
        if value is not None and not value > 0:  # a probe against 0 would always pass
            raise AzuliteError(f"must be > 0, got {value:g}", where=flag, fix=f"give the SKU's figure, e.g. {flag} {example} (A100 80GB)")
    if checkpoint is not None:
        _check_checkpoint_folder(checkpoint)
    if sku is not None:
        from azulite.catalog import get_sku

        entry = get_sku(sku)  # an unknown size: UnknownSku names the nearest ones
        gpus = entry.gpus if gpus is None else gpus
        infiniband = entry.infiniband_gbps > 0 if infiniband is None else infiniband
    exp = Expectations(gpus=gpus, infiniband=infiniband, matmul_tflops=matmul_tflops, gpu_mem_gbps=gpu_mem_gbps,
                       write_gbps=min_write_gbps)
    checks = run_checks(exp, checkpoint=checkpoint, environ=dict(os.environ))
    if json_:
        print(json.dumps(to_json(checks), indent=1))
    else:
        t = Table(title="azulite doctor", title_justify="left")
        for col in ("check", "status", "detail"):
            t.add_column(col)
        for c in checks:
            t.add_row(c.name, f"[{_STYLE[c.status]}]{c.status}[/]", c.detail)
        console = Console(highlight=False, soft_wrap=True)
        console.print(t)
        counts = to_json(checks)["counts"]
        console.print(", ".join(f"{n} {s}" for s, n in counts.items()))
    if failed(checks):
        raise typer.Exit(1)


def _check_checkpoint_folder(location: str) -> None:
    """A local --checkpoint that is (or lies under) a file: the probe would fail with the OS's "File exists";
    said here as what it is, a usage error, before the probes run."""
    from pathlib import Path

    from azulite.train.storage import parse_uri

    try:
        scheme, root = parse_uri(location)
    except AzuliteError as exc:  # a scheme azulite does not write to: the flag's mistake (exit 2), not a failure
        raise AzuliteError(exc.message, where="--checkpoint", fix=exc.fix) from None
    if scheme != "file":
        return
    for p in (Path(root), *Path(root).parents):
        if p.exists() and not p.is_dir():
            what = "is a file, not a folder" if p == Path(root) else f"cannot be a folder: {str(p)!r} is a file"
            raise AzuliteError(f"{location!r} {what}", where="--checkpoint",
                               fix="give the folder checkpoints are written into (a missing one is created for the probe and removed after it), "
                                   "e.g. --checkpoint /mnt/checkpoints/run1, or az://container/dir")
        if p.exists():
            return


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
