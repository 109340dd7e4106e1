"""What the catalog knows about one VM size: its hardware, and its prices each with a source and a date.

A price without a source is not a price: it stays ``None`` (unknown) and every consumer (cost model,
planner) says so instead of guessing.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

#: Price kinds, in the order tables show them.
PRICE_KINDS = ("on_demand", "spot", "reserved_1y", "reserved_3y", "savings_1y", "savings_3y")
CLOUDS = ("azure", "aws", "gcp")


@dataclass(frozen=True)
class Price:
    """USD per VM-hour with where it comes from. ``derived`` names the rule (a seed's percentage off
    on-demand) when the figure was computed rather than stated."""

    usd_per_hour: float
    source: str
    date: str | None = None
    region: str | None = None
    note: str | None = None
    derived: str | None = None

    def label(self) -> str:
        when = f", {self.date}" if self.date else ", undated"
        how = f"; {self.derived}" if self.derived else ""
        return f"{self.source}{when}{how}"


@dataclass(frozen=True)
class Sku:
    """One VM size. ``gpu_memory_gb`` is per GPU; ``infiniband_gbps`` is the VM's total InfiniBand
    bandwidth (0: none)."""

    name: str
    cloud: str
    gpus: int
    gpu_type: str | None
    gpu_memory_gb: float
    vcpus: int
    ram_gb: float
    infiniband_gbps: float
    ib_links: int = 0
    spec_source: str = ""
    notes: str = ""
    prices: Mapping[str, Price] = field(default_factory=lambda: MappingProxyType({}))
    #: the day the cloud retired the size (ISO date; its notes name the notice): no new VM of it can be made
    retired: str | None = None

    @property
    def short(self) -> str:
        """The name without Azure's ``Standard_`` prefix (what seeds and people often write)."""
        return self.name.removeprefix("Standard_")

    @property
    def total_gpu_memory_gb(self) -> float:
        return self.gpus * self.gpu_memory_gb

    def retired_by(self, day: dt.date | None = None) -> bool:
        """Whether the size is retired on ``day`` (today by default)."""
        return self.retired is not None and dt.date.fromisoformat(self.retired) <= (day or dt.date.today())

    def retirement(self) -> str:
        """What to tell a user who names a retired size (empty when it is not retired)."""
        if not self.retired_by():
            return ""
        return (f"{self.name} was retired on {self.retired}: no new VM of this size can be created, and its "
                "prices are the last ones published")

    def price(self, kind: str) -> Price | None:
        """The price of ``kind`` (see PRICE_KINDS) or None when no source gives it."""
        return self.prices.get(kind)
