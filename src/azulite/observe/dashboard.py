"""The web dashboard (``azulite dashboard``): jobs with their attempts, ranks, live log tail, loss and
step-time curves and checkpoints; served models with request rates and latency percentiles from their
servers' metrics; GPUs when present. One page (``dashboard.html``, every asset inline: no external
network) polling a small JSON API.

Loopback by default. Bound anywhere else it requires a key (``Authorization: Bearer KEY``, or ``?key=KEY``
once, which sets a cookie). The job store is read through a read-only connection (never locks the
launcher); a store, metrics target or log that cannot be read is reported in the answer, and the page
says what is missing instead of failing.

The HTTP server is the standard library's threading one: a few operators polling every couple of seconds
need nothing more, and it keeps the dashboard free of the serving stack.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import os
import re
import sqlite3
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from prometheus_client.parser import text_string_to_metric_families

from azulite.contract import CHECKPOINT_OUTPUT
from azulite.errors import AzuliteError
from azulite.launch.records import JobRecord
from azulite.launch.tracking import metric_series
from azulite.observe.jobs import STEP_LINE, ReadOnlyJobStore
from azulite.observe.telemetry import GpuUnavailable, NvmlSource
from azulite.spec.job import Output

PAGE = Path(__file__).with_name("dashboard.html")
MAX_JOBS = 10_000
LOG_TAIL_BYTES = 64 << 10


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---- what the pages show ----------------------------------------------------------------------------
def job_summary(r: JobRecord) -> dict:
    return {"id": r.id, "name": r.name, "state": r.state.value, "attempt": r.attempt, "created_at": r.created_at,
            "started_at": r.started_at, "ended_at": r.ended_at, "exit_code": r.exit_code, "reason": r.reason}


#: the job's MLflow metrics the page draws (as ``azulite.train.log_metrics`` and the checkpointer record them)
CURVES = ("loss", "step_time_s", "samples_per_s")


def training_curves(rec: JobRecord) -> dict:
    """Loss, step time and samples/s per step from the job's MLflow store, read read-only (``job show``
    reads the same store). A job with no store of its own, or no ``loss`` in it, falls back to rank 0's
    log of every attempt (the ``step N loss X step_s T`` lines azulite's examples print)."""
    series = metric_series(rec.job_dir, CURVES)
    if series is not None and series["loss"]:
        steps = sorted(series["loss"])
        return {"source": "mlflow", "step": steps, "loss": [series["loss"][s] for s in steps],
                "step_s": [series["step_time_s"].get(s) for s in steps],
                "samples_per_s": [series["samples_per_s"].get(s) for s in steps]}
    return _curves_from_log(rec)


def _curves_from_log(rec: JobRecord) -> dict:
    points: dict[int, tuple[float, float | None]] = {}
    for p in sorted(rec.processes, key=lambda p: p.attempt):
        if p.kind != "rank" or p.rank != 0 or not p.log:
            continue
        try:
            text = Path(p.log).read_text(errors="replace")
        except OSError:
            continue
        for m in STEP_LINE.finditer(text):
            try:
                loss = float(m.group(2))
                step_s = float(m.group(3)) if m.group(3) else None
            except ValueError:
                continue  # a corrupt line is skipped, the curve goes on
            points[int(m.group(1))] = (loss, step_s)
    steps = sorted(points)
    return {"source": "rank 0 log", "step": steps,
            "loss": [points[s][0] if math.isfinite(points[s][0]) else None for s in steps],
            "step_s": [points[s][1] for s in steps], "samples_per_s": [None] * len(steps)}


def checkpoints(rec: JobRecord) -> dict:
    raw = (rec.spec.get("outputs") or {}).get(CHECKPOINT_OUTPUT)
    if raw is None:
        return {"items": [], "error": None}
    from azulite.train.catalog import list_checkpoints, read_manifest, step_dir
    from azulite.train.storage import CheckpointStorage, StorageSettings

    try:
        location = Output.model_validate(raw).location(rec.job_dir, CHECKPOINT_OUTPUT)
        env = {**os.environ, **rec.spec.get("environment_variables", {})}
        if not location.startswith("az://") and not Path(location).is_dir():
            return {"items": [], "error": None}
        storage = CheckpointStorage(location, StorageSettings.from_environ(env))
        items = []
        for info in list_checkpoints(location, environ=env):
            manifest = read_manifest(storage, step_dir(info.step), info.step) if info.committed else None
            made = datetime.fromisoformat(manifest["created_at"]).timestamp() if manifest else None
            items.append({**asdict(info), "created_at": made, "age_s": (time.time() - made) if made else None})
        return {"items": items, "error": None}
    except (AzuliteError, OSError, ValueError) as exc:
        return {"items": [], "error": str(exc).splitlines()[0]}


def job_detail(store: ReadOnlyJobStore, job_id: str) -> dict:
    rec = store.get(job_id)
    ranks = [{"attempt": p.attempt, "rank": p.rank, "node": p.node, "pid": p.pid, "exit_code": p.exit_code,
              "restarts": p.restarts, "has_log": bool(p.log)}
             for p in rec.processes if p.kind == "rank"]
    return {**job_summary(rec), "attempts": [asdict(a) for a in rec.attempts], "ranks": ranks,
            "events": rec.events[-50:], "checkpoints": checkpoints(rec), "curves": training_curves(rec)}


def log_chunk(store: ReadOnlyJobStore, job_id: str, rank: int, offset: int | None) -> dict:
    """Rank ``rank``'s log of the latest attempt from byte ``offset`` (the tail when None): the page
    appends what is new on each poll."""
    rec = store.get(job_id)
    logs = [p for p in rec.processes if p.kind == "rank" and p.rank == rank and p.log]
    if not logs:
        return {"text": "", "offset": 0, "error": f"no log for rank {rank} yet"}
    path = max(logs, key=lambda p: p.attempt).log
    try:
        size = os.path.getsize(path)
        start = max(0, size - LOG_TAIL_BYTES) if offset is None or offset > size else offset
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(LOG_TAIL_BYTES)
    except OSError as exc:
        return {"text": "", "offset": offset or 0, "error": str(exc)}
    return {"text": data.decode(errors="replace"), "offset": start + len(data), "error": None}


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative (upper bound, count) buckets."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


class ServingView:
    """Scrapes each server's /metrics; rates come from the previous scrape of the same server."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self._last: dict[tuple[str, str], tuple[float, float]] = {}

    def read(self) -> list[dict]:
        return [self._one(u) for u in self.urls]

    def _one(self, url: str) -> dict:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
            fams = {f.name: f for f in text_string_to_metric_families(text)}
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return {"url": url, "models": [], "error": f"cannot read {url}: {exc}"}
        now = time.monotonic()
        models: dict[str, dict] = {}

        def model(s) -> dict:
            key = f'{s.labels.get("model")}:{s.labels.get("version", "")}'
            return models.setdefault(key, {"model": s.labels.get("model"), "version": s.labels.get("version"),
                                           "success": 0, "failure": 0, "buckets": []})

        for s in getattr(fams.get("nv_inference_request_success"), "samples", []):
            model(s)["success"] += s.value
        for s in getattr(fams.get("nv_inference_request_failure"), "samples", []):
            model(s)["failure"] += s.value
        for s in getattr(fams.get("nv_inference_first_response_histogram_ms"), "samples", []):
            if s.name.endswith("_bucket"):
                model(s)["buckets"].append((float(s.labels["le"]), s.value))
        out = []
        for key, m in sorted(models.items()):
            total = m["success"] + m["failure"]
            prev = self._last.get((url, key))
            rate = (total - prev[1]) / (now - prev[0]) if prev and now > prev[0] else None
            self._last[(url, key)] = (now, total)
            out.append({"model": m["model"], "version": m["version"], "success": m["success"], "failure": m["failure"],
                        "rate_per_s": rate, "p50_ms": quantile(0.5, m["buckets"]), "p99_ms": quantile(0.99, m["buckets"]),
                        "has_histogram": bool(m["buckets"])})
        return {"url": url, "models": out, "error": None}


def gpus(source: NvmlSource) -> dict:
    try:
        return {"gpus": [asdict(g) for g in source.read()], "absent": None}
    except GpuUnavailable as exc:
        return {"gpus": [], "absent": str(exc)}


# ---- HTTP --------------------------------------------------------------------------------------------
class Dashboard:
    def __init__(self, db_path: Path, *, serving_urls: list[str] = (), key: str | None = None) -> None:
        self.store = ReadOnlyJobStore(db_path)
        self.serving = ServingView(list(serving_urls))
        self.nvml = NvmlSource()
        self.key = key

    def api(self, path: str, query: dict[str, list[str]]) -> tuple[int, Any]:
        parts = [p for p in path.split("/") if p][1:]  # after "api"
        try:
            if parts == ["jobs"]:
                # the page loads the list once, then polls ?since=CURSOR for the jobs changed since: a
                # 10,000-job store costs one full read, not one every poll
                since = query.get("since", [None])[0]
                cursor, recs, full = self.store.changes(_whole(since, "since"), MAX_JOBS)
                return 200, {"jobs": [job_summary(r) for r in recs], "cursor": cursor, "full": full, "error": None}
            if len(parts) == 2 and parts[0] == "jobs":
                return 200, job_detail(self.store, parts[1])
            if len(parts) == 3 and parts[0] == "jobs" and parts[2] == "log":
                rank = _whole(query.get("rank", ["0"])[0], "rank") or 0
                off = _whole(query.get("offset", [None])[0], "offset")
                return 200, log_chunk(self.store, parts[1], rank, off)
            if parts == ["serving"]:
                return 200, {"servers": self.serving.read()}
            if parts == ["gpus"]:
                return 200, gpus(self.nvml)
        except AzuliteError as exc:  # an unknown job id
            return 404, {"error": str(exc)}
        except sqlite3.Error as exc:
            return 200, {"jobs": [], "error": f"job store unreadable: {exc}"}
        except ValueError as exc:
            return 400, {"error": str(exc)}
        return 404, {"error": f"no such endpoint: {path}"}


def make_handler(dash: Dashboard) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "azulite-dashboard"

        def log_message(self, *args: Any) -> None:  # quiet: operators read the page, not the access log
            pass

        def _authorized(self, query: dict) -> bool:
            if dash.key is None:
                return True
            given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            cookie = self.headers.get("Cookie", "")
            m = re.search(r"(?:^|;\s*)azulite_key=([^;]+)", cookie)
            for candidate in (given, m.group(1) if m else "", query.get("key", [""])[0]):
                if candidate and hmac.compare_digest(candidate, dash.key):
                    return True
            return False

        def _send(self, code: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            url = urlparse(self.path)
            query = parse_qs(url.query)
            if not self._authorized(query):
                self._send(401, b'{"error": "a key is required: Authorization: Bearer KEY, or open /?key=KEY"}',
                           "application/json", {"WWW-Authenticate": "Bearer"})
                return
            extra = {}
            if dash.key and query.get("key"):
                extra["Set-Cookie"] = f"azulite_key={query['key'][0]}; HttpOnly; SameSite=Strict; Path=/"
            if url.path in ("/", "/index.html"):
                self._send(200, PAGE.read_bytes(), "text/html; charset=utf-8", extra)
            elif url.path.startswith("/api/"):
                code, obj = dash.api(url.path, query)
                self._send(code, json.dumps(obj).encode(), "application/json", extra)
            else:
                self._send(404, b'{"error": "not found"}', "application/json")

    return Handler


def _whole(raw: str | None, name: str) -> int | None:
    """A whole-number query parameter (absent or empty: None); anything else is the client's 400."""
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"?{name}= must be a whole number, got {raw!r}") from None


def serve(dash: Dashboard, host: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(dash))
    server.daemon_threads = True
    return server
