"""``azulite dashboard``: the web dashboard, on loopback unless told otherwise (then with a key)."""

from __future__ import annotations

import secrets
from typing import List, Optional
from urllib.parse import urlsplit

import typer
from rich.console import Console

from azulite.errors import SpecError

#: the shortest --key taken, as for the audit seal key (azulite.serve.audit.KEY_MIN): a short one can be guessed
KEY_MIN = 16


def check_metrics_url(url: str) -> str:
    """``url`` when it is an http(s) URL with a host (and a valid port); a SpecError naming --serve-metrics
    otherwise (it was taken at startup and failed on every poll)."""
    try:
        parts = urlsplit(url.strip())
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # a port that is no number or out of range
        parts, port_ok = None, False
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise SpecError(f"{url!r} is not an http(s) URL of a server's metrics", field="--serve-metrics",
                        fix="e.g. --serve-metrics http://127.0.0.1:8002/metrics (azulite serve's --metrics-port)")
    return url.strip()


def check_key(key: str) -> str:
    if len(key) < KEY_MIN:
        raise SpecError(f"the key is {len(key)} characters; at least {KEY_MIN} are needed (a short one can be guessed)",
                        field="--key", fix="omit --key for a random one, printed once; or e.g. --key \"$(openssl rand -hex 16)\"")
    return key


def dashboard(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; anything but loopback requires a key."),
    port: int = typer.Option(8265, "--port", help="Port; 0 picks a free one."),
    serve_metrics: List[str] = typer.Option([], "--serve-metrics", help="A server's metrics URL to watch (repeat), e.g. http://127.0.0.1:8002/metrics."),
    key: Optional[str] = typer.Option(None, "--key", envvar="AZULITE_DASHBOARD_KEY", help="Key required off loopback (default: a new random one, printed once)."),
) -> None:
    """Jobs (state, attempts, ranks, live log tail, loss and step-time curves, checkpoints with age and
    size), served models (requests/s, p50/p99 latency) and GPUs, live in a browser. Every asset is bundled.

      azulite dashboard --serve-metrics http://127.0.0.1:8002/metrics

      azulite dashboard --host 0.0.0.0     # prints the key to open it with
    """
    from azulite.cli.listen import listen
    from azulite.launch.settings import Settings
    from azulite.observe.dashboard import Dashboard, is_loopback, serve

    console = Console(stderr=True, highlight=False)
    serve_metrics = [check_metrics_url(u) for u in serve_metrics]
    if key is not None:
        check_key(key)
    if not is_loopback(host) and not key:
        key = secrets.token_urlsafe(24)
    dash = Dashboard(Settings.from_environ().db_path, serving_urls=serve_metrics, key=key if not is_loopback(host) or key else None)
    server = listen(lambda: serve(dash, host, port), host, port)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{server.server_address[1]}/"
    console.print(f"azulite dashboard: {url}" + (f"?key={key}" if dash.key else ""), markup=False)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard)
