"""``azulite observe``: this node's GPU (DCGM field names, via NVML) and host metrics on a Prometheus
endpoint, loopback by default."""

from __future__ import annotations

import logging
import os
import threading
from typing import List

import typer
from rich.console import Console

from azulite.errors import SpecError


def observe(
    port: int = typer.Option(9400, "--port", help="Metrics port (dcgm-exporter's 9400); 0 picks a free one."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; 0.0.0.0 lets Prometheus reach it from other machines."),
    disk: List[str] = typer.Option(["/"], "--disk", help="Filesystem paths whose use is exported (repeat)."),
    jobs: bool = typer.Option(True, "--jobs/--no-jobs", help="Also export the local job store's jobs (state, restarts, progress, checkpoint age)."),
) -> None:
    """Export GPU metrics (DCGM_FI_DEV_GPU_UTIL, _MEM_COPY_UTIL, _FB_USED, _FB_FREE, _GPU_TEMP, _POWER_USAGE
    with labels gpu, UUID, modelName, Hostname), CPU, memory, disk and network, and the local jobs' state,
    rank restarts, last progress and checkpoint age on /metrics.
    Without GPUs the GPU series are absent and the exporter says so once.

      azulite observe --port 9400

      curl -s localhost:9400/metrics | grep DCGM_FI_DEV_GPU_UTIL
    """
    from prometheus_client import start_http_server

    from azulite.cli.listen import listen
    from azulite.launch.settings import Settings
    from azulite.observe.jobs import JobCollector
    from azulite.observe.telemetry import NodeCollector, registry_for

    console = Console(stderr=True, highlight=False)
    for path in disk:  # a typo'd mount would just be absent from /metrics, with no word why
        if not os.path.isdir(path):
            raise SpecError(f"no folder {path!r} on this machine", field="--disk",
                            fix="name a mounted filesystem's path, e.g. --disk / --disk /mnt/checkpoints")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    collector = NodeCollector(disk_paths=tuple(disk))
    registry = registry_for(collector)
    if jobs:
        registry.register(JobCollector(Settings.from_environ().db_path))
    server, _ = listen(lambda: start_http_server(port, addr=host, registry=registry), host, port)
    console.print(f"azulite observe: metrics on http://{host}:{server.server_port}/metrics", markup=False)
    list(collector.collect())  # say what is (not) exported now, not at the first scrape
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()


def register(app: typer.Typer) -> None:
    app.command("observe")(observe)
