"""azulite.catalog: VM SKUs (GPUs, GPU memory, vCPUs, RAM, InfiniBand) and their prices, as dated and
sourced data files behind a narrow API. The planner and the cost model read prices only from here; nothing
here calls a cloud.

    >>> from azulite.catalog import get_sku
    >>> get_sku("NC24rs_v3").price("on_demand").usd_per_hour
    3.06
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from azulite.catalog.model import CLOUDS, PRICE_KINDS, Price, Sku
from azulite.catalog.store import Catalog


@lru_cache(maxsize=8)
def load_catalog(override: str | None = None) -> Catalog:
    """The packaged catalog with ``override`` (a TOML catalog file) applied; cached per file path."""
    return Catalog.load(override)


def get_sku(name: str, *, catalog: str | Path | None = None) -> Sku:
    """The SKU named ``name``; raises :class:`~azulite.errors.UnknownSku` with the nearest names."""
    return load_catalog(str(catalog) if catalog else None).get(name)


def skus(gpu: str | None = None, *, cloud: str | None = None, catalog: str | Path | None = None) -> list[Sku]:
    """Every SKU, or those with GPU type ``gpu`` (e.g. "A100") and/or on ``cloud``."""
    return load_catalog(str(catalog) if catalog else None).skus(gpu, cloud)


__all__ = ["CLOUDS", "PRICE_KINDS", "Catalog", "Price", "Sku", "get_sku", "load_catalog", "skus"]
