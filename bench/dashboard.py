"""Dashboard: first page load (an empty store) and the jobs page with 10,000 jobs, measured in headless
Chromium (Debian's, through Playwright): navigation start to the jobs table drawn, and the page's own
fetch + render time of the list (``window.__renderMs``: what every 1.5 s update cost when the page
refetched and redrew the list); then what a live update costs now: the page's own time for one
``?since=CURSOR`` poll and patch (``window.__pollMs``), and per request the update against the whole
list (bytes and time over HTTP from this process). Prints one JSON object as the last line.

    .venv/bin/python bench/dashboard.py [--jobs 10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sqlite3
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from azulite.launch.local.store import JobStore  # noqa: E402

AZULITE = str(Path(sys.executable).parent / "azulite")


def start(home: Path) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([AZULITE, "dashboard", "--port", "0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         text=True, env={**os.environ, "AZULITE_HOME": str(home), "PYTHONPATH": str(REPO / "src")})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in p.stderr], daemon=True).start()
    while True:
        m = re.search(r"(http://[\d.]+:\d+/)", lines.get(timeout=120))
        if m:
            return p, m.group(1)


def fill(store: JobStore, home: Path, n: int) -> None:
    """One job through the store's API (the real row format), then n-1 copies of its row in one
    transaction: 10,000 separate create() transactions take minutes on a loaded machine."""
    first = store.create(name="job0", backend="local", spec={"command": "true"}, spec_path=None, environment=None,
                         jobs_dir=home / "jobs")
    db = sqlite3.connect(store.db_path)
    row = db.execute("SELECT * FROM jobs WHERE id=?", (first.id,)).fetchone()
    cols = [d[0] for d in db.execute("SELECT * FROM jobs LIMIT 0").description]
    rows = []
    for i in range(1, n):
        r = dict(zip(cols, row))
        r.update(id=f"job{i % 50}-{i}", name=f"job{i % 50}", created_at=r["created_at"] + i * 1e-3)
        rows.append(tuple(r[c] for c in cols))
    with db:
        db.executemany(f"INSERT INTO jobs ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})", rows)
    db.close()
    assert len(store.list(n + 1)) == n


def measure(browser, url: str, expect_rows: int) -> dict:
    page = browser.new_page()
    page.goto(url)
    page.wait_for_function(f"document.querySelectorAll('#jobs-table tbody tr').length === {expect_rows}", timeout=300_000)
    shown_ms = page.evaluate("performance.now()")  # since navigation start
    render_ms = page.evaluate("window.__renderMs")
    # a live update (every 1.5 s): the page's own time for one ?since= poll and patch, nothing changed
    page.wait_for_function("window.__jobsState && window.__jobsState.polls >= 2", timeout=300_000)
    poll_ms = page.evaluate("window.__pollMs")
    page.close()
    return {"shown_ms": shown_ms, "list_ms": render_ms, "page_update_ms": poll_ms}


def poll_cost(url: str, n: int = 20) -> dict:
    """Median time and bytes of the whole list vs the live update (nothing changed: the steady state)."""
    import urllib.request

    def get(path: str) -> tuple[float, bytes]:
        t0 = time.perf_counter()
        with urllib.request.urlopen(url + path, timeout=120) as r:
            body = r.read()
        return time.perf_counter() - t0, body

    _, body = get("api/jobs")
    cursor = json.loads(body)["cursor"]
    full = [get("api/jobs") for _ in range(n)]
    since = [get(f"api/jobs?since={cursor}") for _ in range(n)]
    assert json.loads(since[0][1])["jobs"] == [], "nothing changed: the update must be empty"
    return {"full_list_ms": statistics.median(t for t, _ in full) * 1e3, "full_list_bytes": len(full[0][1]),
            "update_ms": statistics.median(t for t, _ in since) * 1e3, "update_bytes": len(since[0][1])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox"])
        out = {}
        for label, n in (("empty", 0), ("many", a.jobs)):
            home = Path(tmp) / label
            store = JobStore(home / "jobs.db")
            t0 = time.perf_counter()
            if n:
                fill(store, home, n)
            fill_s = time.perf_counter() - t0
            proc, url = start(home)
            try:
                runs = [measure(browser, url, n) for _ in range(a.repeat)]
                polls = poll_cost(url) if n else {}
            finally:
                proc.terminate()
                proc.wait(30)
            out[label] = {"jobs": n, "shown_ms": statistics.median(r["shown_ms"] for r in runs),
                          "list_ms": statistics.median(r["list_ms"] for r in runs),
                          "page_update_ms": statistics.median(r["page_update_ms"] for r in runs),
                          "store_fill_s": round(fill_s, 1), **polls}
            print(label, out[label], flush=True)
        browser.close()
    print(json.dumps({"bench": "dashboard", "first_page_load_ms": round(out["empty"]["shown_ms"], 1),
                      "jobs": a.jobs, "jobs_page_shown_ms": round(out["many"]["shown_ms"], 1),
                      "jobs_list_fetch_render_ms": round(out["many"]["list_ms"], 1),
                      "page_update_ms": round(out["many"]["page_update_ms"], 1),
                      "poll_full_list_ms": round(out["many"]["full_list_ms"], 2), "poll_full_list_bytes": out["many"]["full_list_bytes"],
                      "poll_update_ms": round(out["many"]["update_ms"], 2), "poll_update_bytes": out["many"]["update_bytes"],
                      "poll_time_ratio_full_over_update": round(out["many"]["full_list_ms"] / out["many"]["update_ms"], 1),
                      "repeat": a.repeat,
                      "load_avg_1m": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
