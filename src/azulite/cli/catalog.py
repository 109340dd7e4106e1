"""``azulite catalog [--gpu A100] [--cloud azure] [--catalog FILE] [--json]``: the SKUs and their prices,
each price with its source and date; a price no source gives shows as "unknown"."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.table import Table

from azulite.errors import CatalogError

if TYPE_CHECKING:
    from azulite.catalog import Sku

_HEAD = {"on_demand": "on-demand", "spot": "spot", "reserved_1y": "RI 1y", "reserved_3y": "RI 3y",
         "savings_1y": "SP 1y", "savings_3y": "SP 3y"}


def sku_json(s: Sku) -> dict:
    from azulite.catalog import PRICE_KINDS

    d = {f.name: getattr(s, f.name) for f in fields(s) if f.name != "prices"}
    return d | {"prices": {k: (asdict(s.prices[k]) if k in s.prices else None) for k in PRICE_KINDS}}


def catalog(
    gpu: Optional[str] = typer.Option(None, "--gpu", help="Only SKUs with this GPU type (V100, T4, A100, H100)."),
    cloud: Optional[str] = typer.Option(None, "--cloud", help="Only this cloud (azure, aws, gcp)."),
    catalog_file: Optional[Path] = typer.Option(None, "--catalog", help="A TOML file adding or overriding SKUs and prices."),
    as_json: bool = typer.Option(False, "--json", help="One JSON array (prices with source and date; null = unknown)."),
    sources: bool = typer.Option(False, "--sources", help="Also list every price's source and date."),
) -> None:
    """List VM SKUs and their prices (USD per VM-hour), each price with its source and date.

    GPUs, GPU memory, vCPUs, RAM and InfiniBand per SKU; on-demand, spot, reserved and savings-plan prices.

    Examples:

      azulite catalog --gpu A100

      azulite catalog --json | jq '.[] | select(.gpus >= 8) | .name'
    """
    from azulite.catalog import PRICE_KINDS, load_catalog  # the catalog (pydantic) only when asked for

    cat = load_catalog(str(catalog_file) if catalog_file else None)
    everything = cat.skus()
    # an unknown --gpu/--cloud would print an empty table and exit 0, as if the catalog had no such SKUs
    for flag, value, known in (("--gpu", gpu, {s.gpu_type for s in everything if s.gpus and s.gpu_type}),
                               ("--cloud", cloud, {s.cloud for s in everything})):
        if value is not None and value.lower() not in {k.lower() for k in known}:
            raise CatalogError(f"{flag}: no SKU in the catalog has {value!r}",
                               fix=f"use one of: {', '.join(sorted(known))}; or add SKUs with --catalog FILE")
    rows = cat.skus(gpu, cloud)
    if not rows:  # each filter matches some SKU, but not together
        clouds = sorted({s.cloud for s in cat.skus(gpu)})
        raise CatalogError(f"no {gpu} SKU on {cloud} in the catalog", where="--gpu/--cloud",
                           fix=f"{gpu} SKUs are on: {', '.join(clouds)}; or add SKUs with --catalog FILE")
    if as_json:
        print(json.dumps([sku_json(s) for s in rows], indent=2))
        return
    out = Console(highlight=False)
    if not out.is_terminal:  # piped: full rows, not folded to 80 columns
        out.width = 220
    table = Table(title="SKUs (USD per VM-hour; * derived from a sourced discount; - unknown)", title_justify="left")
    for col in ("SKU", "cloud", "GPUs", "GPU mem", "vCPU", "RAM GB", "IB Gb/s"):
        table.add_column(col, justify="left" if col in ("SKU", "cloud") else "right")
    for kind in PRICE_KINDS:
        table.add_column(_HEAD[kind], justify="right")
    for s in rows:
        gpus = f"{s.gpus}x {s.gpu_type}" if s.gpus else "-"
        cells = []
        for kind in PRICE_KINDS:
            p = s.price(kind)
            cells.append("-" if p is None else f"{p.usd_per_hour:.3f}{'*' if p.derived else ''}")
        table.add_row(s.short + (f" (retired {s.retired})" if s.retired_by() else ""), s.cloud, gpus, f"{s.gpu_memory_gb:g} GB" if s.gpus else "-", str(s.vcpus),
                      f"{s.ram_gb:g}", f"{s.infiniband_gbps:g}" if s.infiniband_gbps else "-", *cells)
    out.print(table)
    if sources:
        for s in rows:
            for kind, p in s.prices.items():
                out.print(f"  {s.short} {kind}: ${p.usd_per_hour:g} — {p.label()}")
            if s.notes:
                out.print(f"  {s.short} note: {s.notes}")


def register(app: typer.Typer) -> None:
    app.command("catalog")(catalog)
