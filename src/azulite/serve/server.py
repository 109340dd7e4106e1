"""One process, one event loop (uvloop): the data plane, HTTP, gRPC and metrics, as ``tritonserver`` runs
them. Shutdown on SIGINT/SIGTERM is graceful: the listeners close, requests already received are
answered (up to ``drain_timeout_s``), then the models are finalized.

Why one loop: the data plane's batchers and the front-ends then share it with no thread hand-off per
request (measured: a thread hop costs more than the whole HTTP layer on this machine; bench/serving.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from azulite import integrity
from azulite.errors import IntegrityError, ModelLoadError
from azulite.serve.auth import Guard, GuardSettings
from azulite.serve.dataplane import SERVER_NAME, DataPlaneSettings, TritonDataPlane
from azulite.serve.grpc import GrpcServer
from azulite.serve.grpc_h2 import GrpcH2Server
from azulite.serve.http import HttpApp, MetricsApp
from azulite.serve.http_replies import DEFAULT_MAX_INPUT_SIZE
from azulite.serve.http_server import HttpServer
from azulite.serve.limits import ConnectionLimits
from azulite.serve.response_cache import CacheSettings
from azulite.serve.trace_settings import TraceSettings
from azulite.serve.manager import ControlMode

log = logging.getLogger("azulite.serve")
FINALIZE_GRACE_S = 10.0  # past the drain timeout, for the models' finalize() once their executions ended


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    """Triton's flags: a port of 0 binds a free port (see :attr:`Server.ports`); -1 disables that
    endpoint (as ``--allow-http=false`` etc.)."""

    repository: Path
    http_address: str = "0.0.0.0"
    http_port: int = 8000
    grpc_address: str = "0.0.0.0"
    grpc_port: int = 8001
    metrics_address: str = "0.0.0.0"
    metrics_port: int = 8002
    model_control_mode: ControlMode = "none"
    load_models: tuple[str, ...] = ()
    repository_poll_secs: float = 15.0
    strict_readiness: bool = True
    http_max_input_size: int = DEFAULT_MAX_INPUT_SIZE
    drain_timeout_s: float = 30.0
    #: "h2": azulite's own HTTP/2 transport (default, measured fastest); "grpcio": grpc.aio's server.
    grpc_impl: str = "h2"
    #: keys, restricted APIs, rate limits, audit log (None or inactive: none of them, zero cost)
    guard: GuardSettings | None = None
    server_name: str = SERVER_NAME
    #: check model files against the repository manifest (also whenever azulite-manifest.json exists)
    verify: bool = False
    #: the Ed25519 public key (PEM) a signed manifest is checked with
    manifest_key: Path | None = None
    #: per-connection defences of the HTTP/1.1 and HTTP/2 transports (slow, flooding, hostile clients)
    limits: ConnectionLimits = ConnectionLimits()
    #: bind the listening ports with SO_REUSEPORT (the front-ends of ``--workers N`` share them)
    reuse_port: bool = False
    #: None: rate buckets, quotas and drift windows live in this process (one worker, the fastest). A
    #: directory: they live in files there that every worker process of this server shares, so a limit
    #: holds for all of them together and quotas survive a worker's restart (serve/sharedstate.py)
    shared_state_dir: Path | None = None
    #: Triton's trace settings at start (``--trace-config``; serve/trace_settings.py)
    trace: TraceSettings = TraceSettings()
    #: Triton's --disable-auto-complete-config (and --strict-model-config=true): configs used as written
    disable_auto_complete_config: bool = False
    #: Triton's response cache (``--cache-config local,size=N``; serve/response_cache.py)
    cache: CacheSettings = CacheSettings()


def exposure_warnings(s: ServerSettings, ports: Mapping[str, int] | None = None) -> list[str]:
    """What an operator should hear at start: model control reachable from the network with no guard
    runs any client's code (a Python model's model.py comes in the load request). ``ports``: the bound
    ports by endpoint (Server.ports), named instead of the asked ones (a port 0 is any free port)."""
    out = []
    if s.model_control_mode != "explicit":
        return out
    guard = s.guard or GuardSettings()
    for proto, address, port in (("http", s.http_address, s.http_port), ("grpc", s.grpc_address, s.grpc_port)):
        if port < 0 or address in ("127.0.0.1", "::1", "localhost"):
            continue
        port = (ports or {}).get(proto, port)
        guarded = guard.auth or any("model-repository" in r.categories for r in guard.restricted.get(proto, ()))
        if not guarded:
            where = f"{address}:{port}" if port else address  # never "port 0"
            out.append(f"model control is open on {proto} {where} with no guard: anyone who reaches "
                       "it can load a model whose files they send, i.e. run their code in this server. Add "
                       f"--auth (admin keys only), --{proto}-restricted-api model-repository:HEADER=VALUE, "
                       f"or --{proto}-address 127.0.0.1")
    return out


class Server:
    """Start with :meth:`start` inside a running loop; stop with :meth:`stop`. ``ports`` holds the bound
    ports by endpoint name ("http", "grpc", "metrics")."""

    def __init__(self, settings: ServerSettings, dataplane=None) -> None:
        """``dataplane``: answer from this one instead of loading the repository here (a front-end of a
        multi-worker server passes serve/frontend_plane.py's)."""
        self.settings = settings
        self._given = dataplane
        self.dataplane: TritonDataPlane | None = None
        self.http: HttpServer | None = None
        self.grpc: GrpcServer | GrpcH2Server | None = None
        self.metrics: HttpServer | None = None
        self.ports: dict[str, int] = {}
        self.guard: Guard | None = None
        self._stopped: asyncio.Event | None = None

    async def start(self) -> dict[str, int]:
        s = self.settings
        self._stopped = asyncio.Event()
        verify = _manifest_check(Path(s.repository), s.verify, s.manifest_key)  # a bad manifest: error at start
        guard = self.guard = (Guard(s.guard, shared_state_dir=s.shared_state_dir)
                              if s.guard is not None and s.guard.active else None)
        # Loading models blocks (ONNX sessions, TorchScript, Python initialize): nothing is served yet.
        self.dataplane = self._given or TritonDataPlane(DataPlaneSettings(
            repository=Path(s.repository), control_mode=s.model_control_mode, load_models=s.load_models,
            strict_readiness=s.strict_readiness, server_name=s.server_name, verify_model=verify,
            shared_state_dir=s.shared_state_dir, trace=s.trace,
            disable_auto_complete_config=s.disable_auto_complete_config, cache=s.cache))
        try:
            if s.http_port >= 0:
                self.http = HttpServer(HttpApp(self.dataplane, guard, max_input_size=s.http_max_input_size),
                                       max_input_size=s.http_max_input_size,
                                       limits=s.limits)
                self.http.reuse_port = s.reuse_port
                self.ports["http"] = await self.http.start(s.http_address, s.http_port)
            if s.grpc_port >= 0:
                self.grpc = (GrpcH2Server(self.dataplane, guard, s.limits) if s.grpc_impl == "h2"
                             else GrpcServer(self.dataplane, guard=guard, limits=s.limits))
                self.grpc.reuse_port = s.reuse_port
                self.ports["grpc"] = await self.grpc.start(s.grpc_address, s.grpc_port)
            if s.metrics_port >= 0:
                m = self.dataplane.metrics
                if guard is not None:
                    m.extra.append(guard_metrics(guard))
                self.metrics = HttpServer(MetricsApp(m.metrics_text, m.content_type))
                self.metrics.reuse_port = s.reuse_port
                self.ports["metrics"] = await self.metrics.start(s.metrics_address, s.metrics_port)
        except OSError:
            await self.stop(0)
            raise
        if s.model_control_mode == "poll":
            self.dataplane.start_polling(s.repository_poll_secs)
        return self.ports

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Close the listeners, answer what is in flight, finalize the models. Idempotent."""
        if self._stopped is not None and self._stopped.is_set():
            return
        timeout = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout  # one --exit-timeout-secs for the whole stop, not one per stage
        fronts = []
        if self.http is not None:
            fronts.append(self.http.drain(timeout))
        if self.grpc is not None:
            fronts.append(self.grpc.drain(timeout))
        await asyncio.gather(*fronts, return_exceptions=True)
        if self.dataplane is not None:
            # As Triton's --exit-timeout-secs: the server stops even if an execution is still running (a
            # batcher's close waits for it, then finalizes); its request stays counted in dataplane.in_flight.
            left = max(0.0, deadline - loop.time())
            try:
                await asyncio.wait_for(self.dataplane.shutdown(left), left + FINALIZE_GRACE_S)
            except asyncio.TimeoutError:
                log.warning("stopping with %d request(s) still executing after %.1f s", self.dataplane.in_flight,
                            timeout)
        if self.metrics is not None:
            await self.metrics.drain(0)
        if self.guard is not None:
            self.guard.close()
        if self._stopped is not None:
            self._stopped.set()

    async def wait_stopped(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()


def _manifest_check(repository: Path, verify: bool, public_key: Path | None):
    """The data plane's per-model check, or None when the repository has no manifest and --verify is off.
    The manifest is read (and its signature checked) at start, so a broken one stops the server with the
    file named, and again at each load, so a re-signed repository is honoured by later (re)loads."""
    if not verify and not integrity.has_manifest(repository) and public_key is None:
        return None
    if not integrity.has_manifest(repository):
        raise IntegrityError(f"--verify: the repository has no {integrity.MANIFEST}",
                             where=str(repository), fix="write it first: azulite repo sign REPO")
    integrity.load_manifest(repository, public_key)

    def check(root: Path, name: str) -> None:
        try:
            integrity.load_manifest(repository, public_key).check_model(name, root)
        except IntegrityError as exc:
            raise ModelLoadError(str(exc), where=f"model '{name}'") from None

    return check


def guard_metrics(guard: Guard):
    """The guard's counters as Prometheus metrics (read at scrape time; serve/guard_counts.families)."""
    from azulite.serve.guard_counts import families, snapshot

    return lambda: families(snapshot(guard))


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (measured ~30% more HTTP throughput here), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep working without it
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def serve(settings: ServerSettings, *, on_started: Callable[[Server], None] | None = None,
          on_stopping: Callable[[str], None] | None = None) -> None:
    """Run until SIGINT/SIGTERM, then drain and return (``azulite serve``'s body)."""
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    server = Server(settings)

    async def main() -> None:
        await server.start()
        # The start-up objects (modules, models, configs) live as long as the process: move them out of
        # the cyclic collector's reach so a full collection pauses for µs, not ~10 ms. Measured with
        # perf_analyzer at c=32 over HTTP, 6 alternating runs: p99 8-12 ms with it, 10-37 ms without.
        gc.collect()
        gc.freeze()
        stop = asyncio.Event()
        names: dict[int, str] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            names[sig] = sig.name
            loop.add_signal_handler(sig, lambda sig=sig: (names.__setitem__(0, names[sig]), stop.set()))
        if on_started is not None:
            on_started(server)
        await stop.wait()
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal during the drain: default action
            loop.remove_signal_handler(sig)
        if on_stopping is not None:
            on_stopping(names.get(0, "signal"))
        await server.stop()

    try:
        loop.run_until_complete(main())
    finally:
        try:
            loop.run_until_complete(server.stop(0))
        finally:
            loop.close()
