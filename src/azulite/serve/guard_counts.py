"""The guard's counters (requests refused by status, audit lines written / lost / dropped) of every
front-end of ``azulite serve --workers N`` as one view: each front-end publishes its own counts to a file
of its own in the server's run directory, and the model host, which answers every front-end's /metrics,
sums them all.

Why files and not prometheus-client's multiprocess mode: the counts are kept by the guard itself
(serve/auth.py, serve/audit.py: plain integers, one writer each), so they would have to be copied into
prometheus-client's counters anyway, and its mode is switched on for the whole process by an environment
variable read at import, which would change the host's own metrics too. A file per process is what that
mode does as well; ours holds a few numbers as JSON, replaced atomically.

A front-end publishes when its counts changed, at most every ``PUBLISH_INTERVAL_S``, at every scrape that
reaches it and when it stops; a file outlives its process (named by pid), so a front-end that dies and
is replaced never takes its counts back: the sum only grows, as a counter must. What a front-end killed
with SIGKILL counted after its last publish is lost (at most one interval's worth).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

PUBLISH_INTERVAL_S = 0.25
_AUDIT = (
    ("written", "azulite_audit_lines_written", "Audit log lines written"),
    ("write_errors", "azulite_audit_write_errors", "Audit log lines lost to a failed write"),
    ("dropped", "azulite_audit_dropped", "Audit log lines dropped because the writer fell behind"),
)


def snapshot(guard) -> dict:
    """A guard's counts as plain data."""
    audit = guard.audit
    return {"rejected": dict(guard.rejected),
            "audit": None if audit is None else {key: getattr(audit, key) for key, _, _ in _AUDIT}}


class Publisher:
    """One front-end's counts, kept in ``<folder>/<pid>.json`` (``name`` instead of the pid)."""

    def __init__(self, guard, folder: Path, *, name: str = "") -> None:
        self.guard = guard
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{name or os.getpid()}.json"
        self._last: dict | None = None
        self._timer: asyncio.TimerHandle | None = None

    def publish(self) -> None:
        counts = snapshot(self.guard)
        if counts == self._last:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(counts))
        tmp.replace(self.path)  # a reader sees the old counts or the new ones, never half a file
        self._last = counts

    def start(self) -> None:
        self.publish()
        loop = asyncio.get_running_loop()

        def tick() -> None:
            self.publish()
            self._timer = loop.call_later(PUBLISH_INTERVAL_S, tick)

        self._timer = loop.call_later(PUBLISH_INTERVAL_S, tick)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.publish()


def merged(folder: Path) -> dict:
    """Every published file's counts summed (files that vanish or are being replaced are skipped)."""
    rejected: dict[str, int] = {}
    audit: dict[str, int] | None = None
    try:
        files = sorted(folder.glob("*.json"))
    except OSError:
        files = []
    for path in files:
        try:
            counts = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for status, n in counts.get("rejected", {}).items():
            rejected[status] = rejected.get(status, 0) + int(n)
        if counts.get("audit") is not None:
            audit = audit or {key: 0 for key, _, _ in _AUDIT}
            for key in audit:
                audit[key] += int(counts["audit"].get(key, 0))
    return {"rejected": rejected, "audit": audit}


def families(counts: dict):
    """The guard's counts (:func:`snapshot`'s shape) as Prometheus counter families: named as Prometheus
    names counters (``azulite_requests_rejected_total``, ...: promtool flagged them without ``_total``)."""
    from prometheus_client.core import Metric

    rejected = Metric("azulite_requests_rejected", "Requests refused by the guard, by status", "counter")
    for status, n in sorted(counts["rejected"].items()):
        rejected.add_sample("azulite_requests_rejected_total", {"status": status}, n)
    yield rejected
    if counts["audit"] is not None:
        for key, name, doc in _AUDIT:
            metric = Metric(name, doc, "counter")
            metric.add_sample(name + "_total", {}, counts["audit"][key])
            yield metric


def merged_metrics(folder: Path):
    """A collector for the model host's registry: the same families a single-process server's guard
    exports (serve/server.py guard_metrics), summed over every front-end."""
    return lambda: families(merged(folder))
