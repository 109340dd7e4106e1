"""``azulite serve REPO``: a Triton-compatible server (KServe v2 over HTTP and gRPC, Prometheus metrics)
on a Triton model repository, with ``tritonserver``'s flag names.

Thin: flags -> :class:`~azulite.serve.server.ServerSettings`; prints the models table and the endpoints
when serving; SIGINT/SIGTERM drain in-flight requests before exiting. Bad flags and an unusable
repository are AzuliteErrors (exit 2, no traceback).
"""

from __future__ import annotations

import os
import re
import sys
from functools import partial
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from azulite.cli import console as consoles
from azulite.cli.listen import check_address, check_port
from azulite.errors import AzuliteError, SpecError, StartupError

_STYLE = {"READY": "bold green", "UNLOADED": "dim", "UNAVAILABLE": "bold red"}
_LIMITS = "Connection limits (slow, flooding and hostile clients; see serve/limits.py)"


def _bool(value: str, flag: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise SpecError(f"takes true or false, got {value!r}", field=flag, fix=f"e.g. {flag} false")


def _table(rows: list[tuple[str, str, str]]) -> Table:
    table = Table(title="Models", title_justify="left")
    table.add_column("Model")
    table.add_column("Version")
    table.add_column("Status", overflow="fold")
    for name, version, status in rows:
        style = _STYLE.get(status.split(":", 1)[0], "white")
        table.add_row(name, version, f"[{style}]{status}[/]")
    return table


def serve(
    repository: Optional[str] = typer.Argument(None, help="The model repository (Triton's layout): a folder or az://container/path.",
                                               show_default=False),
    model_repository: Optional[str] = typer.Option(None, "--model-repository", "--model-store",
                                                   help="Same as REPOSITORY (tritonserver's flag)."),
    http_port: int = typer.Option(8000, "--http-port", help="HTTP port (0: any free port)."),
    grpc_port: int = typer.Option(8001, "--grpc-port", help="gRPC port (0: any free port)."),
    metrics_port: int = typer.Option(8002, "--metrics-port", help="Prometheus metrics port."),
    http_address: str = typer.Option("0.0.0.0", "--http-address", help="Address the HTTP endpoint listens on "
                                     "(127.0.0.1: this machine only)."),
    grpc_address: str = typer.Option("0.0.0.0", "--grpc-address", help="Address the gRPC endpoint listens on."),
    metrics_address: str = typer.Option("0.0.0.0", "--metrics-address", help="Address the metrics endpoint listens on."),
    allow_http: str = typer.Option("true", "--allow-http", help="false: no HTTP endpoint."),
    allow_grpc: str = typer.Option("true", "--allow-grpc", help="false: no gRPC endpoint."),
    allow_metrics: str = typer.Option("true", "--allow-metrics", help="false: no metrics endpoint."),
    model_control_mode: str = typer.Option("none", "--model-control-mode",
                                           help="none | explicit | poll (Triton's model control modes)."),
    load_model: Optional[List[str]] = typer.Option(None, "--load-model",
                                                   help="Explicit mode: load this model at start (repeatable; '*': all)."),
    repository_poll_secs: float = typer.Option(15.0, "--repository-poll-secs",
                                               help="Poll mode: seconds between repository scans."),
    strict_readiness: str = typer.Option("true", "--strict-readiness",
                                         help="true: ready only when every start-up model loaded."),
    exit_on_error: str = typer.Option("false", "--exit-on-error",
                                      help="true: exit 1 when a start-up model fails to load (Triton's default is "
                                           "true; here the others serve on)."),
    http_max_input_size: int = typer.Option(64 * 1024 * 1024, "--http-max-input-size",
                                            help="Largest HTTP request body in bytes (larger: 413)."),
    exit_timeout_secs: float = typer.Option(30.0, "--exit-timeout-secs",
                                            help="On SIGINT/SIGTERM, how long to drain in-flight requests."),
    log_verbose: int = typer.Option(0, "--log-verbose", help="1 or more: verbose lines (a model's log_verbose, "
                                    "each failure's details, the libraries' info). Changeable at run time: v2/logging."),
    log_info: str = typer.Option("true", "--log-info", help="false: no info lines."),
    log_warning: str = typer.Option("true", "--log-warning", help="false: no warning lines."),
    log_error: str = typer.Option("true", "--log-error", help="false: no error lines."),
    log_format: str = typer.Option("default", "--log-format", help="default or ISO8601 (UTC) times."),
    disable_auto_complete_config: bool = typer.Option(
        False, "--disable-auto-complete-config", help="Use each config.pbtxt as written: no auto-complete from the "
        "model file (a model without config.pbtxt then fails to load)."),
    strict_model_config: Optional[str] = typer.Option(
        None, "--strict-model-config", help="tritonserver's older flag: true is --disable-auto-complete-config."),
    cache_config: Optional[List[str]] = typer.Option(
        None, "--cache-config", help="Triton's response cache: local,size=BYTES (models opt in with "
        "response_cache { enable: true })."),
    trace_config: Optional[List[str]] = typer.Option(
        None, "--trace-config", help="Triton's: triton,file=PATH, triton,log-frequency=N, rate=N, "
        "level=TIMESTAMPS, count=N (repeatable); or spans over OTLP/HTTP: mode=opentelemetry, "
        "opentelemetry,url=URL, opentelemetry,resource=KEY=VALUE, opentelemetry,bsp_schedule_delay=MS; "
        "level, rate and count changeable at run time: v2/trace/setting."),
    grpc_impl: str = typer.Option("h2", "--grpc-impl",
                                  help="h2: azulite's HTTP/2 gRPC transport (fastest); grpcio: grpc.aio's server."),
    auth: bool = typer.Option(False, "--auth", help="Every endpoint but liveness/readiness needs a key "
                              "(Authorization: Bearer; see azulite keys)."),
    key_store: Optional[Path] = typer.Option(None, "--key-store", help="Key store for --auth "
                                             "(default $AZULITE_HOME/keys.db)."),
    quota_ledger: Optional[Path] = typer.Option(None, "--quota-ledger",
                                                help="Where the day's quota usage outlives a restart (SQLite; "
                                                "default: KEY_STORE.usage beside the key store)."),
    model_rate_limit: Optional[List[str]] = typer.Option(None, "--model-rate-limit",
                                                         help="MODEL=RPS: inference requests per second for a "
                                                         "model, all keys together (repeatable)."),
    http_restricted_api: Optional[List[str]] = typer.Option(None, "--http-restricted-api",
                                                            help="CATEGORY[,CATEGORY]:HEADER=VALUE (Triton's flag)."),
    grpc_restricted_api: Optional[List[str]] = typer.Option(None, "--grpc-restricted-api",
                                                            help="CATEGORY[,CATEGORY]:HEADER=VALUE (Triton's flag)."),
    audit_log: Optional[Path] = typer.Option(None, "--audit-log", help="Write one JSON line per request here."),
    audit_log_max_bytes: int = typer.Option(64 * 1024 * 1024, "--audit-log-max-bytes",
                                            help="Rotate the audit log past this size (5 old files kept)."),
    audit_seal: bool = typer.Option(False, "--audit-seal", help="Seal the audit log: each write ends with a line "
                                    "chaining a SHA-256 of its lines to the one before (azulite audit verify)."),
    audit_key: Optional[Path] = typer.Option(None, "--audit-key", help="Seal with HMAC-SHA256 under this key file "
                                             "(16+ bytes): no one without it can rewrite the chain."),
    server_name: str = typer.Option("azulite", "--server-name",
                                    help="The name /v2 and ServerMetadata report (Triton's clients expect "
                                    "'triton')."),
    verify: bool = typer.Option(False, "--verify", help="Refuse models whose files do not match the "
                                "repository manifest (always on when azulite-manifest.json exists)."),
    manifest_key: Optional[Path] = typer.Option(None, "--manifest-key",
                                                help="Ed25519 public key (PEM) that a signed manifest must verify with."),
    max_connections: Optional[int] = typer.Option(
        None, "--max-connections", rich_help_panel=_LIMITS,
        help="Open connections per listener (HTTP, gRPC) past which a new one gets 503 / GOAWAY and is closed "
             "(default 0, no limit; gRPC: --grpc-impl h2 only)."),
    header_timeout_secs: Optional[float] = typer.Option(
        None, "--header-timeout-secs", rich_help_panel=_LIMITS,
        help="Slowloris: seconds a request head (HTTP/2: the preface and first SETTINGS) may take (default 30)."),
    max_header_bytes: Optional[int] = typer.Option(
        None, "--max-header-bytes", rich_help_panel=_LIMITS,
        help="Largest request head / HTTP/2 header block (HTTP: 431) (default 65536; at least 4096)."),
    max_continuation_frames: Optional[int] = typer.Option(
        None, "--max-continuation-frames", rich_help_panel=_LIMITS,
        help="HTTP/2 CONTINUATION flood: frames in one header block (default 32; h2 only)."),
    max_pipelined_requests: Optional[int] = typer.Option(
        None, "--max-pipelined-requests", rich_help_panel=_LIMITS,
        help="HTTP/1.1: requests read ahead of their answers before reading pauses (default 64)."),
    max_concurrent_streams: Optional[int] = typer.Option(
        None, "--max-concurrent-streams", rich_help_panel=_LIMITS,
        help="HTTP/2 (gRPC) streams open at once per connection, advertised and enforced (default 1024)."),
    rapid_reset_allowance: Optional[int] = typer.Option(
        None, "--rapid-reset-allowance", rich_help_panel=_LIMITS,
        help="HTTP/2 rapid reset (CVE-2023-44487): streams a client may cancel beyond those it let finish "
             "(default 200; h2 only)."),
    max_control_frames: Optional[int] = typer.Option(
        None, "--max-control-frames", rich_help_panel=_LIMITS,
        help="HTTP/2 SETTINGS/PING/WINDOW_UPDATE floods: control frames between two new streams "
             "(default 10000; h2 only)."),
    stall_timeout_secs: Optional[float] = typer.Option(
        None, "--stall-timeout-secs", rich_help_panel=_LIMITS,
        help="Seconds an answer may wait on a client that does not read (zero-window stall) (default 30)."),
    max_write_buffer_bytes: Optional[int] = typer.Option(
        None, "--max-write-buffer-bytes", rich_help_panel=_LIMITS,
        help="Answers queued for a client that does not read before it is paused or cut off "
             "(default 8388608)."),
    grpc_max_message_bytes: Optional[int] = typer.Option(
        None, "--grpc-max-message-bytes", rich_help_panel=_LIMITS,
        help="Largest gRPC request message (larger: RESOURCE_EXHAUSTED) (default 67108864). HTTP bodies: "
             "--http-max-input-size."),
    grpc_max_buffered_bytes: Optional[int] = typer.Option(
        None, "--grpc-max-buffered-bytes", rich_help_panel=_LIMITS,
        help="gRPC request bytes buffered per connection, all streams, before it is closed "
             "(default 268435456; h2 only)."),
    workers: int = typer.Option(1, "--workers", help="Front-end processes sharing the ports, with the models in "
                                "one host process and Python model instances in their own (0: the usable cores, "
                                "at most 4; 1: one process, as before)."),
) -> None:
    """Serve a Triton model repository over KServe v2 HTTP and gRPC, with Triton-named metrics.

    Examples:

      azulite serve model_repository/

      azulite serve model_repository/ --http-port 8000 --grpc-port 8001 --metrics-port 8002

      azulite serve model_repository/ --model-control-mode explicit --load-model densenet_onnx

      azulite serve model_repository/ --auth --audit-log audit.jsonl --verify
    """
    from azulite.cli.keys import default_store
    from azulite.serve import log_settings
    from azulite.serve.auth import GuardSettings, parse_restricted
    from azulite.serve.limits import limits_from_flags
    from azulite.serve.server import exposure_warnings
    from azulite.serve.server import ServerSettings
    from azulite.serve.server import serve as serve_one
    from azulite.serve.response_cache import parse_cache_config
    from azulite.serve.trace_settings import parse_trace_config

    repo = model_repository or repository
    if repository is not None and model_repository is not None and repository != model_repository:
        raise SpecError(f"two repositories given: {repository!r} and --model-repository {model_repository!r}",
                        field="REPOSITORY", fix="give the repository once: as REPOSITORY or as --model-repository")
    if repo is None:
        raise SpecError("no model repository given", field="REPOSITORY",
                        fix="azulite serve path/to/model_repository")
    remote = None
    if repo.startswith("az://"):
        # mirrored into a local cache (AZULITE_MODEL_CACHE); re-synced each --repository-poll-secs
        from azulite.serve.remote import RemoteRepository

        cache = os.environ.get("AZULITE_MODEL_CACHE") or Path(os.environ.get("AZULITE_HOME") or Path.home() / ".azulite") / "model-cache"
        remote = RemoteRepository(repo, cache)
        remote.sync()
        repo = remote.path
    repo = Path(repo)
    if not repo.is_dir():
        what = "is not a directory" if repo.exists() else "does not exist"
        raise SpecError(f"model repository {str(repo)!r} {what}", field="REPOSITORY",
                        fix="point at a directory holding <model>/config.pbtxt and <model>/<version>/")
    if model_control_mode not in ("none", "explicit", "poll"):
        raise SpecError(f"unknown --model-control-mode {model_control_mode!r}", field="--model-control-mode",
                        fix="use none, explicit or poll")
    if load_model and model_control_mode != "explicit":
        raise SpecError("needs --model-control-mode explicit", field="--load-model",
                        fix=f"add --model-control-mode explicit (or drop --load-model: mode {model_control_mode} loads "
                            "every model)")
    ports = {"--http-port": http_port, "--grpc-port": grpc_port, "--metrics-port": metrics_port}
    for flag, port in ports.items():
        check_port(port, flag)
    for flag, other in (("--http-port", "--grpc-port"), ("--http-port", "--metrics-port"),
                        ("--grpc-port", "--metrics-port")):
        if ports[flag] and ports[flag] == ports[other]:  # the second listener would fail with "address in use"
            raise SpecError(f"{flag} and {other} are both {ports[flag]}", field=other,
                            fix="give each endpoint its own port (0: any free port)")
    for flag, address in (("--http-address", http_address), ("--grpc-address", grpc_address),
                          ("--metrics-address", metrics_address)):
        check_address(address, flag)
    if grpc_impl not in ("h2", "grpcio"):
        raise SpecError(f"unknown --grpc-impl {grpc_impl!r}", field="--grpc-impl", fix="use h2 or grpcio")
    if repository_poll_secs <= 0:
        raise SpecError(f"must be positive, got {repository_poll_secs:g}", field="--repository-poll-secs",
                        fix="e.g. --repository-poll-secs 15")
    if http_max_input_size < 1:
        raise SpecError(f"must be a positive number of bytes, got {http_max_input_size}", field="--http-max-input-size",
                        fix="e.g. --http-max-input-size 67108864 (64 MiB)")
    if not exit_timeout_secs >= 0:  # a negative drain would read "up to -1 s" and end at once
        raise SpecError(f"must be >= 0 seconds, got {exit_timeout_secs:g}", field="--exit-timeout-secs",
                        fix="e.g. --exit-timeout-secs 30 (0: stop without draining)")
    limits = limits_from_flags({
        "max_connections": max_connections, "header_timeout_s": header_timeout_secs,
        "max_header_bytes": max_header_bytes, "max_continuations": max_continuation_frames,
        "max_pipelined": max_pipelined_requests, "max_streams": max_concurrent_streams,
        "reset_allowance": rapid_reset_allowance, "max_control_frames": max_control_frames,
        "stall_timeout_s": stall_timeout_secs, "max_write_buffer": max_write_buffer_bytes,
        "max_message_bytes": grpc_max_message_bytes, "max_buffered_bytes": grpc_max_buffered_bytes,
    }, grpc_impl=grpc_impl)
    if (audit_seal or audit_key is not None) and audit_log is None:  # nothing to seal: the user thinks it is
        raise SpecError("seals the audit log, and there is none", field="--audit-key" if audit_key else "--audit-seal",
                        fix="add --audit-log FILE")
    if audit_key is not None:
        from azulite.serve.audit import read_key

        read_key(audit_key)  # unreadable or short: said now, not by every front-end at start
    if audit_log is not None and (audit_log.is_dir() or any(p.exists() and not p.is_dir() for p in audit_log.parents)):
        # the server would start and count every line as a write error (a failed write never fails a request)
        raise SpecError("is a directory" if audit_log.is_dir() else "lies under a file, not a folder",
                        file=str(audit_log), field="--audit-log", fix="name a file in a folder, e.g. --audit-log "
                        f"{audit_log / 'audit.jsonl' if audit_log.is_dir() else 'audit.jsonl'}")
    if audit_log is not None:
        try:  # a folder that cannot be made was reported as the ports failing to listen
            audit_log.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SpecError(f"its folder cannot be made: {exc.strerror or exc}", file=str(audit_log),
                            field="--audit-log", fix="name a file in a folder this user can write") from None
        try:  # opened (created) now: a log that cannot be written would lose every line, seen only in a metric
            with audit_log.open("ab"):
                pass
        except OSError as exc:
            raise SpecError(f"cannot be written: {exc.strerror or exc}", file=str(audit_log), field="--audit-log",
                            fix="name a file this user can write (its folder is made when missing)") from None
    if audit_log_max_bytes < 1:  # 0 or less never rotated: the log grew without bound
        raise SpecError(f"must be a positive number of bytes, got {audit_log_max_bytes}", field="--audit-log-max-bytes",
                        fix="e.g. --audit-log-max-bytes 67108864 (64 MiB; 5 rotated files are kept)")
    if quota_ledger is not None and not auth:
        raise SpecError("is only used with --auth", field="--quota-ledger", fix="add --auth, or drop --quota-ledger")
    if key_store is not None and not auth:  # the server would run open while the user thinks it is guarded
        raise SpecError("is only read with --auth", field="--key-store",
                        fix=f"add --auth (every endpoint but health then needs a key from {key_store})")
    if auth:
        from azulite.cli.keys import check_store_path

        check_store_path(key_store)
    exit_on_error_ = _bool(exit_on_error, "--exit-on-error")
    if log_verbose < 0:
        raise SpecError(f"must be 0 or more, got {log_verbose}", field="--log-verbose", fix="e.g. --log-verbose 1")
    if log_format not in log_settings.FORMATS:
        raise SpecError(f"must be one of {', '.join(log_settings.FORMATS)}, got {log_format!r}", field="--log-format")
    log_initial = log_settings.LogSettings(
        log_info=_bool(log_info, "--log-info"), log_warning=_bool(log_warning, "--log-warning"),
        log_error=_bool(log_error, "--log-error"), log_verbose_level=log_verbose, log_format=log_format)
    if not _bool(allow_http, "--allow-http") and not _bool(allow_grpc, "--allow-grpc"):
        raise SpecError("with --allow-http false too, no endpoint would take an inference request",
                        field="--allow-grpc", fix="keep one of --allow-http and --allow-grpc true")
    settings = ServerSettings(
        repository=repo,
        http_address=http_address, http_port=http_port if _bool(allow_http, "--allow-http") else -1,
        grpc_address=grpc_address, grpc_port=grpc_port if _bool(allow_grpc, "--allow-grpc") else -1,
        metrics_address=metrics_address,
        metrics_port=metrics_port if _bool(allow_metrics, "--allow-metrics") else -1,
        model_control_mode=model_control_mode,  # type: ignore[arg-type]
        load_models=tuple(load_model or ()),
        repository_poll_secs=repository_poll_secs,
        strict_readiness=_bool(strict_readiness, "--strict-readiness"),
        http_max_input_size=http_max_input_size,
        drain_timeout_s=exit_timeout_secs,
        grpc_impl=grpc_impl,
        trace=parse_trace_config(trace_config or ()),
        cache=parse_cache_config(cache_config or ()),
        disable_auto_complete_config=disable_auto_complete_config or (
            strict_model_config is not None and _bool(strict_model_config, "--strict-model-config")),
        guard=GuardSettings(
            auth=auth, key_store=(key_store or default_store()) if auth else None,
            model_rps=tuple(_rate(item) for item in model_rate_limit or ()),
            restricted={"http": tuple(parse_restricted(t, "--http-restricted-api") for t in http_restricted_api or ()),
                        "grpc": tuple(parse_restricted(t, "--grpc-restricted-api") for t in grpc_restricted_api or ())},
            audit_log=audit_log, audit_max_bytes=audit_log_max_bytes, quota_ledger=quota_ledger,
            audit_seal=audit_seal or audit_key is not None, audit_key=audit_key),
        server_name=server_name,
        verify=verify,
        manifest_key=manifest_key,
        limits=limits,
    )
    if not server_name.strip():
        raise SpecError("--server-name is empty", field="--server-name", fix="e.g. --server-name triton")
    console = consoles.out()

    running = []

    def started(server) -> None:
        running.append(server)
        rows = server.dataplane.startup_table()
        console.print(_table(rows))
        for warning in [*exposure_warnings(settings, server.ports), *_unknown_limited(settings)]:
            console.print(f"[bold yellow]warning:[/] {warning}")  # (the bound ports, was "port 0")
        failed = sorted({name for name, _, status in rows if status.startswith("UNAVAILABLE")})
        serving = sorted({name for name, _, status in rows if status.startswith("READY")})
        if failed and exit_on_error_:
            raise StartupError(f"model(s) failed to load: {', '.join(failed)} (reasons in the table above)",
                               where="--exit-on-error",
                               fix="fix those models, or drop --exit-on-error to serve the others")
        names = {"grpc": ("GRPCInferenceService", grpc_address), "http": ("HTTPService", http_address),
                 "metrics": ("Metrics Service", metrics_address)}
        for key in ("grpc", "http", "metrics"):
            if key in server.ports:
                label, address = names[key]
                console.print(f"Started {label} at {address}:{server.ports[key]}")
        summary = (f"serving: {', '.join(serving) or 'no model'}"
                   + (f"; failed to load: {', '.join(failed)}" if failed else ""))
        if server.dataplane.ready():
            console.print(f"[bold green]azulite serve ready[/] (model control mode: {model_control_mode}; {summary}); "
                          "Ctrl-C or SIGTERM drains and stops")
        else:
            console.print(f"[bold yellow]azulite serve started but NOT ready[/]: /v2/health/ready answers 400 "
                          f"while a start-up model is not loaded ({summary}); --strict-readiness false: ready "
                          "as soon as it serves")

    def stopping(signame: str) -> None:
        console.print(f"{signame}: draining in-flight requests (up to {exit_timeout_secs:g} s), then stopping")

    if workers < 0:
        raise SpecError(f"--workers {workers} is negative", field="--workers", fix="0 (one per usable core), 1, 2, ...")
    if workers == 0:
        from azulite.serve.workers import default_workers

        workers = default_workers()
    run = serve_one
    if workers > 1:
        from azulite.serve.workers import serve_workers

        run = partial(serve_workers, workers=workers)
    # the process's logging, once every flag is checked (a refused flag changes nothing in the caller)
    log_settings.install(log_initial)
    if remote is not None:
        remote.start_polling(repository_poll_secs)
    try:
        run(settings, on_started=started, on_stopping=stopping)
    except OSError as exc:
        # name the flag whose port is taken where the message says which port (asyncio's does; --workers' does not)
        asked = [f"{flag} {port}" for flag, port in ports.items() if port]
        named = [f for f in asked if re.search(rf"\b{f.split()[1]}\b", str(exc))] or asked
        raise AzuliteError(f"cannot listen: {exc}", where=" or ".join(named) or None,
                           fix="choose free ports with --http-port/--grpc-port/--metrics-port (0 picks any free "
                               "port)") from None
    finally:
        if remote is not None:
            remote.stop()
    console.print("azulite serve stopped")
    abandoned = running[0].dataplane.in_flight if running else 0
    if abandoned:
        # a model execution outlived --exit-timeout-secs: its thread would hold the interpreter's exit
        # (executor threads are joined at exit) for as long as the model runs; stop now, as Triton does
        console.print(f"{abandoned} request(s) still executing after --exit-timeout-secs {exit_timeout_secs:g}: "
                      "exiting without their answers")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _unknown_limited(settings) -> list[str]:
    """A --model-rate-limit naming a model the repository lacks (a typo limits nothing, silently)."""
    from azulite.serve.repository import list_models

    try:
        models = set(list_models(Path(settings.repository)))
    except Exception:  # noqa: BLE001 - the server said what is wrong with the repository already
        return []
    return [f"--model-rate-limit {name}={rps:g}: the repository has no model '{name}' (its models: "
            f"{', '.join(sorted(models)) or 'none'}); the limit applies if one of that name appears"
            for name, rps in settings.guard.model_rps if name not in models]


def _rate(item: str) -> tuple[str, float]:
    name, sep, value = item.partition("=")
    try:
        rps = float(value)
    except ValueError:
        rps = -1.0
    if not sep or not name or not rps > 0:
        raise SpecError(f"--model-rate-limit {item!r} is not MODEL=RPS", field="--model-rate-limit",
                        fix="e.g. --model-rate-limit densenet_onnx=200")
    return name, rps


def register(app: typer.Typer) -> None:
    """Adds the ``serve`` command to the top-level app."""
    app.command("serve", no_args_is_help=True)(serve)
