"""``azulite serve --workers N``: one model host process (serve/host.py: models, batchers, statistics)
behind N front-end processes (HTTP, gRPC, metrics) that share the listening ports with SO_REUSEPORT,
so the kernel spreads connections over them. This process only supervises:

- it reserves the ports first (a port of 0 becomes one concrete port all front-ends bind);
- starts the host, waits until its start-up models loaded, then starts the front-ends;
- restarts a front-end that dies (the others keep serving) and counts it
  (``azulite_worker_restarts_total{role="frontend"}``); if the host dies, it restarts the host and
  then every front-end (``role="host"``): the models live there;
- on SIGINT/SIGTERM drains the front-ends first (they answer what they accepted, which needs the host),
  then the host (its batchers finish, its models are finalized).

Every child gets its settings over a socketpair whose end-of-file also tells it that this supervisor is
gone (a child never outlives it). One temporary directory per server (0700) holds the host's socket, the
restart counts and ``state/``, handed to every front-end as ``ServerSettings.shared_state_dir`` for the
per-request protection state that must be shared across processes.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from azulite.errors import AzuliteError, SpecError
from azulite.serve import ipc, log_settings

log = logging.getLogger("azulite.serve.workers")
#: past this, the one host's loop is the limit: on 16 cores (stop 44) 4 front-ends answered at most 11% more
#: than 2 and 8 up to 34% less (each sees fewer requests per loop pass to coalesce; README: workers)
MAX_DEFAULT_WORKERS = 4
START_TIMEOUT_S = 600.0  # a host loading big models may take minutes


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    return max(1, min(usable_cores(), MAX_DEFAULT_WORKERS))


@dataclass(slots=True)
class StartedView:
    """What ``serve``'s on_started callback reads (the CLI prints the table and the ports)."""

    ports: dict[str, int]
    table: list[tuple[str, str, str]]
    is_ready: bool
    dataplane: "StartedView | None" = None
    in_flight: int = 0

    def startup_table(self) -> list[tuple[str, str, str]]:
        return self.table

    def ready(self) -> bool:
        return self.is_ready


@dataclass(slots=True)
class _Child:
    role: str
    index: int
    proc: subprocess.Popen
    sock: socket.socket
    info: tuple = ()


@dataclass
class Pool:
    settings: "object"
    workers: int
    run_dir: Path
    reserved: list[socket.socket] = field(default_factory=list)
    host: _Child | None = None
    frontends: list[_Child | None] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=lambda: {"frontend": 0, "host": 0})

    # --- children ----------------------------------------------------------------------------------

    def _spawn(self, role: str, index: int, message: tuple) -> _Child:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        proc = subprocess.Popen([sys.executable, "-m", "azulite.serve.workers", role, str(theirs.fileno())],
                                pass_fds=[theirs.fileno()])
        theirs.close()
        ipc.send_frame(mine, message)
        return _Child(role, index, proc, mine)

    def _await_ready(self, child: _Child) -> None:
        mine = child.sock
        mine.settimeout(START_TIMEOUT_S)
        try:
            header, _ = ipc.recv_frame(mine)
        except (ConnectionError, OSError):
            if child.proc.poll() is None:  # not ready in time
                child.proc.kill()
            code = child.proc.wait()
            raise AzuliteError(f"the {child.role} process exited while starting (exit code {code}; its "
                               "error is above)") from None
        mine.settimeout(None)
        if header[0] == "error":
            child.proc.wait()
            raise AzuliteError(header[1])
        child.info = header[1:]

    def start_host(self) -> None:
        path = self.run_dir / "host.sock"
        path.unlink(missing_ok=True)
        self.host = self._spawn("host", 0, ("start", self.settings, str(self.run_dir), self.workers))
        self._await_ready(self.host)

    def frontend_settings(self):
        return replace(self.settings, reuse_port=True, shared_state_dir=self.run_dir / "state")

    def start_frontends(self, indexes: list[int]) -> None:
        """Start them all, then wait for each (they start side by side)."""
        children = [self._spawn("frontend", i, ("start", self.frontend_settings(), str(self.run_dir / "host.sock")))
                    for i in indexes]
        for i, child in zip(indexes, children):
            self.frontends[i] = child
        for child in children:
            self._await_ready(child)

    def start(self) -> StartedView:
        self.ports = self._reserve_ports()
        self.settings = replace(self.settings, http_port=self.ports.get("http", -1),
                                grpc_port=self.ports.get("grpc", -1), metrics_port=self.ports.get("metrics", -1))
        self._write_restarts()
        self.start_host()
        self.frontends = [None] * self.workers
        self.start_frontends(list(range(self.workers)))
        table, ready = self.host.info  # type: ignore[union-attr]
        view = StartedView(ports=dict(self.ports), table=table, is_ready=ready)
        view.dataplane = view
        return view

    def _reserve_ports(self) -> dict[str, int]:
        """Bind (never listen) each port with SO_REUSEPORT here: a port of 0 becomes the one every
        front-end binds, and no other user's process can take it while the server runs."""
        s = self.settings
        ports = {}
        for name, address, port in (("http", s.http_address, s.http_port), ("grpc", s.grpc_address, s.grpc_port),
                                    ("metrics", s.metrics_address, s.metrics_port)):
            if port < 0:
                continue
            family, kind, proto, _, addr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(addr)
            self.reserved.append(sock)
            ports[name] = sock.getsockname()[1]
        return ports

    def _write_restarts(self) -> None:
        tmp = self.run_dir / "restarts.json.tmp"
        tmp.write_text(json.dumps(self.restarts))
        tmp.replace(self.run_dir / "restarts.json")

    # --- supervision -------------------------------------------------------------------------------

    def supervise(self, wakeup: socket.socket) -> None:
        """Until a signal arrives on ``wakeup``: restart what dies."""
        while True:
            children = {c.sock.fileno(): c for c in [self.host, *self.frontends] if c is not None}
            readable, _, _ = select.select([wakeup, *[c.sock for c in children.values()]], [], [])
            if wakeup in readable:
                return
            for sock in readable:
                child = children[sock.fileno()]
                code = child.proc.wait()
                child.sock.close()
                if child.role == "frontend":
                    log.warning("front-end worker %d (pid %d) exited with %s: starting it again", child.index,
                                child.proc.pid, code)
                    self.restarts["frontend"] += 1
                    self._write_restarts()
                    self.frontends[child.index] = None
                    self.start_frontends([child.index])
                else:
                    log.warning("the model host (pid %d) exited with %s: starting it and every front-end again",
                                child.proc.pid, code)
                    self.restarts["host"] += 1
                    self._write_restarts()
                    self._stop_frontends(0.0)
                    self.start_host()
                    self.start_frontends(list(range(self.workers)))
                    break  # the children all changed

    def _stop(self, child: _Child | None, timeout_s: float) -> None:
        if child is None or child.proc.poll() is not None:
            return
        child.proc.send_signal(signal.SIGTERM)
        try:
            child.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s %d did not stop within %.0f s: killing it", child.role, child.proc.pid, timeout_s)
            child.proc.kill()
            child.proc.wait()

    def _stop_frontends(self, drain_timeout_s: float) -> None:
        for child in self.frontends:
            if child is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in self.frontends:
            self._stop(child, drain_timeout_s + 15.0)
            if child is not None:
                child.sock.close()
        self.frontends = [None] * self.workers

    def stop(self) -> None:
        timeout = self.settings.drain_timeout_s  # type: ignore[attr-defined]
        # one --exit-timeout-secs for the whole stop: the host drains in what the front-ends left of it
        deadline = time.time() + timeout
        (Path(self.run_dir) / STOP_BY).write_text(repr(deadline))
        self._stop_frontends(timeout)
        self._stop(self.host, max(0.0, deadline - time.time()) + 15.0)
        if self.host is not None:
            self.host.sock.close()
        for sock in self.reserved:
            sock.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


RUN_DIR_PREFIX = "azulite-serve-"


def sweep_run_dirs() -> list[Path]:
    """The run folders of servers whose supervisor is gone (killed with SIGKILL: its ``finally`` never ran),
    removed: those of this user whose ``supervisor.pid`` names no live process. -> the folders removed."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(RUN_DIR_PREFIX + "*"):
        try:
            if path.stat().st_uid != os.getuid():
                continue
            pid = int((path / "supervisor.pid").read_text())
        except (OSError, ValueError):  # not ours to judge (no pid: made by another version, or being made)
            continue
        try:
            os.kill(pid, 0)
            continue  # its server runs (or the pid was reused: left, as a live server's would be)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.info("removed %d run folder(s) of servers that were killed: %s", len(removed),
                 ", ".join(p.name for p in removed))
    return removed


def serve_workers(settings, workers: int, *, on_started: Callable | None = None,
                  on_stopping: Callable[[str], None] | None = None) -> None:
    """``serve`` with N front-end processes: run until SIGINT/SIGTERM, then drain every worker."""
    if workers < 2:
        raise SpecError(f"--workers {workers}: the multi-process server needs at least 2", field="--workers")
    if settings.grpc_impl != "h2" and settings.grpc_port >= 0:
        raise SpecError("--grpc-impl grpcio cannot share its port between worker processes", field="--grpc-impl",
                        fix="use --grpc-impl h2 (the default) with --workers")
    sweep_run_dirs()
    run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
    (run_dir / "state").mkdir()
    (run_dir / "supervisor.pid").write_text(str(os.getpid()))
    pool = Pool(settings=settings, workers=workers, run_dir=run_dir)
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    got: list[str] = []

    def on_signal(signum, _frame) -> None:
        got.append(signal.Signals(signum).name)
        try:
            wake_w.send(b"x")
        except OSError:
            pass

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        view = pool.start()
        if on_started is not None:
            on_started(view)
        if not got:
            pool.supervise(wake_r)
        for sig, handler in old.items():  # a second signal during the drain: default action
            signal.signal(sig, handler)
        if on_stopping is not None:
            on_stopping(got[0] if got else "signal")
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        pool.stop()
        wake_r.close()
        wake_w.close()


# --- the children ----------------------------------------------------------------------------------

def worker_metrics(run_dir: Path, workers: int):
    """Restart counts kept by the supervisor, read at scrape time (they survive a host restart)."""
    from prometheus_client.core import Metric

    def collect():
        try:
            counts = json.loads((run_dir / "restarts.json").read_text())
        except (OSError, ValueError):
            counts = {}
        metric = Metric("azulite_worker_restarts", "Worker processes started again after dying", "counter")
        for role in ("frontend", "host"):
            metric.add_sample("azulite_worker_restarts_total", {"role": role}, counts.get(role, 0))
        yield metric
        gauge = Metric("azulite_workers", "Front-end worker processes configured", "gauge")
        gauge.add_sample("azulite_workers", {}, workers)
        yield gauge

    return collect


#: the wall-clock time by which a stopping server is to be done (the supervisor writes it in the run folder)
STOP_BY = "stop-by"


def _time_left(run_dir: Path, timeout_s: float) -> float:
    """What is left of the stop's --exit-timeout-secs (all of it when the supervisor wrote no deadline: it died)."""
    try:
        return max(0.0, min(timeout_s, float((run_dir / STOP_BY).read_text()) - time.time()))
    except (OSError, ValueError):
        return timeout_s


async def _until_stopped(sock: socket.socket) -> None:
    """SIGTERM, or the supervisor gone (its end of the socketpair closed)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(sock.fileno(), stop.set)
    await stop.wait()
    loop.remove_reader(sock.fileno())


async def _host_main(sock: socket.socket, settings, run_dir: str, workers: int) -> None:
    from azulite.serve import guard_counts
    from azulite.serve.dataplane import DataPlaneSettings, TritonDataPlane
    from azulite.serve.host import ModelHost
    from azulite.serve.server import FINALIZE_GRACE_S, _manifest_check

    s = settings
    verify = _manifest_check(Path(s.repository), s.verify, s.manifest_key)
    journal_path = Path(run_dir) / "models.json"  # written by the host before this one (a restart), if any
    journal = json.loads(journal_path.read_text()) if journal_path.exists() else None
    dp = TritonDataPlane(DataPlaneSettings(
        repository=Path(s.repository), control_mode=s.model_control_mode, load_models=s.load_models,
        strict_readiness=s.strict_readiness, server_name=s.server_name, verify_model=verify,
        instance_processes=True, trace=s.trace, disable_auto_complete_config=s.disable_auto_complete_config,
        cache=s.cache, control_journal=journal_path))
    if journal is not None and s.model_control_mode == "explicit":
        await dp.replay(journal)
    dp.metrics.extra.append(worker_metrics(Path(run_dir), workers))
    dp.metrics.extra.append(guard_counts.merged_metrics(Path(run_dir) / "guard"))
    host = ModelHost(dp, str(Path(run_dir) / "host.sock"))
    await host.start()
    if s.model_control_mode == "poll":
        dp.start_polling(s.repository_poll_secs)
    gc.collect()
    gc.freeze()
    ipc.send_frame(sock, ("ready", dp.startup_table(), dp.ready()))
    await _until_stopped(sock)
    await host.stop_accepting()
    left = _time_left(Path(run_dir), s.drain_timeout_s)
    try:
        await asyncio.wait_for(dp.shutdown(left), left + FINALIZE_GRACE_S)
    except asyncio.TimeoutError:
        log.warning("model host: stopping with %d request(s) still executing", dp.in_flight)
    await host.close()


async def _frontend_main(sock: socket.socket, settings, host_path: str) -> None:
    from azulite.serve import guard_counts
    from azulite.serve.frontend_plane import RemoteDataPlane
    from azulite.serve.server import Server

    plane = RemoteDataPlane(host_path)
    await plane.connect()
    server = Server(settings, dataplane=plane)
    ports = await server.start()
    counts = None
    if server.guard is not None:  # its counters join the other front-ends' in the host's /metrics
        counts = guard_counts.Publisher(server.guard, Path(host_path).parent / "guard")
        counts.start()
        plane.metrics.refresh.append(counts.publish)
    gc.collect()
    gc.freeze()
    ipc.send_frame(sock, ("ready", ports))
    await _until_stopped(sock)
    await server.stop()
    if counts is not None:
        counts.close()  # after the guard's close: the audit lines it flushed are counted


def main(argv: list[str]) -> None:
    from azulite.serve.server import new_event_loop

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which stops us in order
    role, fd = argv[0], int(argv[1])
    log_settings.install(prefix=f"{role}[%(process)d] ")  # the server's settings file, from the environment
    sock = socket.socket(fileno=fd)
    header, _ = ipc.recv_frame(sock)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        if role == "host":
            loop.run_until_complete(_host_main(sock, *header[1:]))
        else:
            loop.run_until_complete(_frontend_main(sock, *header[1:]))
    except AzuliteError as exc:
        try:
            ipc.send_frame(sock, ("error", str(exc)))
        except OSError:
            pass
        sys.exit(1)
    finally:
        loop.close()
        # stubs and executor threads must not hold the exit
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
