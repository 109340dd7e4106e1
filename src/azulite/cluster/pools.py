"""Node pools as the simulator sees them: a cluster spec's pools resolved against the catalog (GPUs per
node, the price that applies), and which pools a job may run on (node selector, tolerations of taints).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

from azulite.catalog import Catalog, load_catalog
from azulite.errors import SpecError, UnknownSku
from azulite.spec.cluster import SPOT_TAINT, ClusterSpec, pool_line


@dataclass(frozen=True)
class Pool:
    name: str
    sku: str
    node_gpus: int
    usd_per_hour: float | None   # None: no source gives this price (cost reported as unknown)
    price_label: str
    min_nodes: int
    max_nodes: int
    start_nodes: int
    spot: bool = False
    evictions_per_hour: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[str, ...] = ()

    @property
    def usd_per_gpu_hour(self) -> float:
        if self.usd_per_hour is None or not self.node_gpus:
            return float("inf")
        return self.usd_per_hour / self.node_gpus


def resolve_pools(spec: ClusterSpec, *, catalog: Catalog | None = None, spec_file: str | Path | None = None) -> list[Pool]:
    """The spec's pools with their SKU facts. AKS puts the spot taint on spot pools itself, so it is
    added here too: a job needs the matching toleration to land on spot nodes."""
    cat = catalog or load_catalog()
    out = []
    for i, p in enumerate(spec.pools):
        try:
            sku = cat.get(p.sku)
        except UnknownSku as exc:
            line = pool_line(spec_file, i) if spec_file else None
            raise SpecError(exc.message, file=str(spec_file) if spec_file else None, line=line, field=f"pools[{i}].sku",
                            value=p.sku, fix=exc.fix) from None
        kind = "spot" if p.spot else p.pricing
        price = sku.price(kind)
        taints = tuple(str(t) for t in p.taints if t.effect in ("NoSchedule", "NoExecute"))
        if p.spot and SPOT_TAINT not in taints:
            taints += (SPOT_TAINT,)
        labels = {"agentpool": p.name, "kubernetes.azure.com/agentpool": p.name,
                  "node.kubernetes.io/instance-type": sku.name, **p.labels}
        if p.spot:
            labels.setdefault("kubernetes.azure.com/scalesetpriority", "spot")
        out.append(Pool(
            name=p.name, sku=sku.name, node_gpus=sku.gpus, usd_per_hour=price.usd_per_hour if price else None,
            price_label=f"{kind} " + (f"${price.usd_per_hour:g}/h ({price.label()})" if price else "unknown (no source)"),
            min_nodes=p.min_nodes, max_nodes=p.max_nodes, start_nodes=p.start_nodes, spot=p.spot,
            evictions_per_hour=p.evictions_per_hour, labels=labels, taints=taints,
        ))
    return out


#: a taint's effects (Kubernetes); a toleration without one tolerates them all
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME}$")  # a label key: [DNS-prefix/]name
_VALUE = re.compile(rf"^({_NAME})?$")
TOLERATION_FORMS = ("key=value:Effect (operator Equal), key:Effect (Exists: any value), key=value or key (any effect); "
                    f"Effect is {', '.join(EFFECTS[:-1])} or {EFFECTS[-1]}")


def check_toleration(text: str) -> str | None:
    """What is wrong with the toleration ``text`` (Kubernetes' key, operator Equal or Exists, value and effect
    in one string: see TOLERATION_FORMS), or None. A misspelt effect would tolerate no taint and move the job
    off the pools it was meant for, without a word."""
    kv, colon, effect = text.partition(":")
    key, eq, value = kv.partition("=")
    if colon and effect not in EFFECTS:
        close = difflib.get_close_matches(effect, EFFECTS, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]}?)" if close else ""
        what = "an empty effect after ':'" if not effect else f"effect {effect!r}"
        return f"{what} is not one of {', '.join(EFFECTS)}{hint}"
    if not _KEY.match(key):
        return f"key {key!r} is not a Kubernetes label key ([prefix/]name, name 1-63 letters, digits, '-', '_', '.')"
    if eq and not _VALUE.match(value):
        return f"value {value!r} is not a Kubernetes label value (up to 63 letters, digits, '-', '_', '.')"
    return None


def _tolerates(tolerations: tuple[str, ...], taint: str) -> bool:
    """A toleration ``key=value:Effect`` matches that taint; ``key:Effect`` or ``key`` any value (Exists)."""
    kv, _, effect = taint.partition(":")
    key, _, value = kv.partition("=")
    for t in tolerations:
        tkv, _, teffect = t.partition(":")
        tkey, sep, tvalue = tkv.partition("=")
        if tkey == key and (not sep or tvalue == value) and (not teffect or teffect == effect):
            return True
    return False


def eligible(pools: list[Pool], selector: tuple[tuple[str, str], ...], tolerations: tuple[str, ...]) -> list[int]:
    """Indices of GPU pools whose labels satisfy ``selector`` and whose taints ``tolerations`` all tolerate."""
    out = []
    for i, p in enumerate(pools):
        if p.node_gpus < 1:
            continue
        if any(p.labels.get(k) != v for k, v in selector):
            continue
        if all(_tolerates(tolerations, t) for t in p.taints):
            out.append(i)
    return out
