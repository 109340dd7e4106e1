"""``azulite bench collectives``: collective bandwidth with nccl-tests' semantics, run as a job through a
launch backend (local: simulated nodes on this machine)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from azulite.bench.nccl_tests import OPS, table
from azulite.errors import BenchError, BenchInputError
from azulite.launch.backend import get_backend
from azulite.launch.settings import Settings

app = typer.Typer(
    no_args_is_help=True,
    help=(
        "Measure the machine and the cluster.\n\n"
        "Examples:\n\n"
        "  azulite bench collectives                                  # 2 simulated nodes x 2 ranks, 1 KB..64 MB\n\n"
        "  azulite bench collectives --ops all_reduce --min-bytes 64M --json"
    ),
)

_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)B?\s*$", re.I)


def parse_size(text: str, flag: str) -> int:
    """``1024``, ``64K``, ``64M``, ``1G`` (binary units, as nccl-tests) -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise BenchInputError(f"{text!r} is not a size", where=flag, fix="a number of bytes with an optional K, M or G: 64M")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


@app.command("collectives")
def collectives(
    ops: str = typer.Option(",".join(OPS), "--ops", help="Comma-separated collectives."),
    min_bytes: str = typer.Option("1K", "--min-bytes", "-b", help="Smallest size S (nccl-tests -b)."),
    max_bytes: str = typer.Option("64M", "--max-bytes", "-e", help="Largest size S (nccl-tests -e)."),
    factor: int = typer.Option(2, "--factor", "-f", help="Size multiplier between steps (nccl-tests -f)."),
    iters: int = typer.Option(20, "--iters", "-n", help="Timed operations per size."),
    warmup: int = typer.Option(5, "--warmup", "-w", help="Untimed operations per size."),
    nodes: int = typer.Option(2, "--nodes", help="Nodes (simulated on this machine by the local backend)."),
    procs_per_node: int = typer.Option(2, "--procs-per-node", help="Ranks per node (GPUs per node on a cluster)."),
    instance_type: Optional[str] = typer.Option(None, "--instance-type", help="SKU (a catalog name: azulite catalog), recorded with the job."),
    catalog_file: Optional[Path] = typer.Option(None, "--catalog", help="A TOML catalog file with your own SKUs (for --instance-type)."),
    backend: Optional[str] = typer.Option(None, "--backend", help="Launch backend (default: AZULITE_BACKEND or local)."),
    timeout: float = typer.Option(3600, "--timeout", help="Seconds before the job is ended (a hung collective fails, exit 124)."),
    json_: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """all_reduce, all_gather, reduce_scatter, alltoall and broadcast over a size sweep: time, algbw = S/t,
    busbw (nccl-tests' factors), #wrong from a check of every result, and the memory-copy bandwidth as the
    local limit. gloo on CPU, nccl on GPU. Exits 1 if any result is wrong.

      azulite bench collectives --nodes 2 --procs-per-node 2 -b 1K -e 64M -f 4
    """
    from azulite.bench.jobs import collectives_job, empty_code_dir, run_collectives  # the job spec (pydantic)

    if instance_type is not None:  # a typo was recorded with the job as given, as cost and doctor --sku refuse it
        instance_type = _known_sku(instance_type, catalog_file)
    settings = Settings.from_environ()
    b = get_backend(backend or settings.backend, settings, where=f"--backend {backend}" if backend else "AZULITE_BACKEND")
    with empty_code_dir() as code:
        spec = collectives_job(
            nodes=nodes, procs_per_node=procs_per_node, ops=[o.strip() for o in ops.split(",") if o.strip()],
            min_bytes=parse_size(min_bytes, "--min-bytes"), max_bytes=parse_size(max_bytes, "--max-bytes"),
            factor=factor, iters=iters, warmup=warmup, code=code, instance_type=instance_type, timeout_s=timeout,
        )
        job_id, result = run_collectives(b, spec)
    result["job_id"] = job_id
    if json_:
        print(json.dumps(result, indent=1))
    else:
        Console(highlight=False, soft_wrap=True).print(
            table(result["rows"], world_size=result["world_size"], backend=result["backend"],
                  memcopy_gbps=result["memcopy_gbps"]), markup=False)
    wrong = [r for r in result["rows"] if r["wrong"]]
    if wrong:
        raise BenchError(
            f"{len(wrong)} result(s) wrong, first: {wrong[0]['op']} at {wrong[0]['size']} B "
            f"({wrong[0]['wrong']} element(s))", where=f"job {job_id}",
            fix="the interconnect or the collective library returns bad data: run `azulite doctor` on the nodes")


def _known_sku(name: str, catalog_file: Optional[Path] = None) -> str:
    """The catalog's name of the SKU ``name`` (``NC24rs_v3`` -> ``Standard_NC24rs_v3``); UnknownSku, naming
    --instance-type and the nearest names, when the catalog has none such."""
    from azulite.catalog import load_catalog
    from azulite.errors import UnknownSku

    try:
        return load_catalog(str(catalog_file) if catalog_file else None).get(name).name
    except UnknownSku as exc:
        raise UnknownSku(exc.name, exc.suggestions, where="--instance-type") from None
