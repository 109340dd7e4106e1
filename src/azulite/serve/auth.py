"""Who may call what: endpoint keys (``--auth``), restricted API categories (Triton's
``--http-restricted-api`` / ``--grpc-restricted-api``), rate limits and quotas, and the audit log's
record of each request — one :class:`Guard` that both transports ask, once per request, before the
data plane sees anything.

Categories are Triton's (docs/customization_guide/inference_protocols.md, "restricted APIs"): health,
metadata, inference, shared-memory, model-config, model-repository, statistics, trace, logging. Server
liveness and readiness stay open (probes carry no key); everything else needs a valid key under
``--auth``, and a key reaches only its models. Categories that can change what the server runs or
reveal what others do are admin-only under ``--auth``: :data:`ADMIN_CATEGORIES` plus every category
named restricted by a flag. A restricted category with a header (``CATEGORY:HEADER=VALUE``) also
needs that header, with or without ``--auth``.

The hot path with a guard (:meth:`Guard.check_http` over HTTP, :meth:`Guard.check_request`): one dict
lookup of the request's plan (the ``Authorization`` value as sent, protocol, category, model (HTTP: the
path) of a request that passed the full check before: the salted sha256, compared in constant time, runs
once per key and key-store version), a compare of the key store's WAL-index header
(keystore.CommitWatch: has anyone committed?), the key's expiry, the bucket and quota takes (in one call
in one process; one lock for all of them when shared). When the header moved, ``PRAGMA data_version``
says whether the keys changed and they are reloaded, the verified tokens and plans forgotten: a
revocation committed by the CLI takes effect on the very next request — in every worker process of a
server alike. ``reload_interval_s`` is only a backstop (data_version asked that often whatever the header
says). With ``shared_state_dir`` the buckets and quotas are those of all the workers together
(serve/sharedstate.py); without it, this process's own.

A key store replaced at its path (a Kubernetes Secret's symlink swap, a restore, a deploy copying a new
file) is reopened at the next reload: the open connection kept reading the old file, revocations and
all. A store gone from its path, or that cannot be read, refuses every key until it is back (logged).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from azulite.errors import KeyStoreError, PermissionDenied, ServeError, SpecError, Unauthenticated
# the route tables are re-exported: importers of azulite.serve.auth keep finding them here
from azulite.serve.api_routes import (ADMIN_CATEGORIES, CATEGORIES, GRPC_ROUTES, OPEN, bearer,  # noqa: F401
                                      http_route, http_route_infer)
from azulite.serve.audit import AuditLog, read_key
from azulite.serve.keystore import WAL_HEADER, CommitWatch, KeyRecord, KeyStore, check_token, split_token
from azulite.serve.quota_ledger import LedgerWriter, QuotaLedger, ledger_path
from azulite.serve.ratelimit import Clock, DailyQuotas, SystemClock, TokenBuckets, planned_take, refuse
from azulite.serve.sharedstate import LIMITS_FILE, SharedDailyQuotas, SharedTokenBuckets, SlotTable


@dataclass(frozen=True, slots=True)
class Restriction:
    """``--http-restricted-api model-repository,model-config:admin-key=s3cret``"""

    categories: tuple[str, ...]
    header: str
    value: str


def parse_restricted(text: str, flag: str) -> Restriction:
    """Triton's syntax: ``CATEGORY[,CATEGORY...]:HEADER=VALUE``."""
    cats, sep, rest = text.partition(":")
    header, sep2, value = rest.partition("=")
    example = f"{flag} model-repository,model-config:admin-key=CHANGE-ME"
    if not sep or not sep2 or not header.strip() or not value:
        raise SpecError(f"{flag} {text!r} is not CATEGORY[,CATEGORY...]:HEADER=VALUE", field=flag, fix=example)
    names = tuple(c.strip() for c in cats.split(",") if c.strip())
    for c in names:
        if c not in CATEGORIES:
            raise SpecError(f"{flag}: unknown API category {c!r}", field=flag,
                            fix=f"use some of {', '.join(CATEGORIES)}")
    if not names:
        raise SpecError(f"{flag} {text!r} names no category", field=flag, fix=example)
    return Restriction(names, header.strip().lower(), value)


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller a request was checked as. ``key_id`` None: no key (auth off, or an open endpoint)."""

    key_id: str | None = None
    models: frozenset[str] | None = None
    admin: bool = False

    def may_see(self, model: str) -> bool:
        return self.models is None or model in self.models


ANONYMOUS = Principal()


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardSettings:
    """``auth``: require keys from ``key_store``. ``model_rps``: per-model inference limits.
    ``restricted``: per protocol ("http", "grpc"), Triton's restricted-API flags. ``audit_log``: a JSON-lines
    file (None: no audit)."""

    auth: bool = False
    key_store: Path | None = None
    model_rps: tuple[tuple[str, float], ...] = ()
    restricted: dict[str, tuple[Restriction, ...]] = field(default_factory=dict)
    audit_log: Path | None = None
    audit_max_bytes: int = 64 * 1024 * 1024
    audit_backups: int = 5
    #: seal the audit log (audit_writer.py): with SHA-256, or HMAC-SHA256 under the key in ``audit_key``
    audit_seal: bool = False
    audit_key: Path | None = None
    reload_interval_s: float = 0.2
    #: where the day's quota usage outlives a restart (serve/quota_ledger.py); None: beside the key store
    quota_ledger: Path | None = None

    @property
    def active(self) -> bool:
        return bool(self.auth or self.model_rps or any(self.restricted.values()) or self.audit_log)


log = logging.getLogger("azulite.serve.auth")
_NO_STORE = -2  # the keys' version while the store is gone or unreadable


def _of(record: KeyRecord | None, exc: ServeError) -> ServeError:
    """A refusal for a key that authenticated, naming it for the audit log (``refused_key``)."""
    if record is not None:
        exc.key_id = record.id  # type: ignore[attr-defined]
    return exc


def refused_key(exc: BaseException) -> str | None:
    """The key a refusal was for: the key of a 403 / 429, or the live key a 401's wrong secret was tried
    against (who is being guessed at); None when no key was known."""
    return getattr(exc, "key_id", None)


def _file_id(path: Path | None) -> tuple[int, int] | None:
    """The file at ``path`` (device, inode; links followed), or None when there is none."""
    try:
        st = os.stat(path)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None
    return st.st_dev, st.st_ino


class Guard:
    """``check(...)`` answers a Principal or raises Unauthenticated / PermissionDenied / ResourceExhausted.
    Thread-safe (grpcio may call from its own threads)."""

    def __init__(self, settings: GuardSettings, *, clock: Clock | None = None,
                 shared_state_dir: Path | None = None) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        self.auth = settings.auth
        self.store: KeyStore | None = None
        self._keys: dict[str, KeyRecord] = {}
        self._version = -1
        #: token -> (record, principal) of keys already verified: the hash is computed once per key and
        #: key-store version. A reload replaces the dict (a thread verifying against the old keys at that
        #: moment fills the old one, never the new)
        self._verified: dict[str, tuple[KeyRecord, Principal]] = {}
        self._watch: CommitWatch | None = None
        self._wal = None  # the key store's mapped WAL-index header (keystore.CommitWatch), under --auth
        self._store_id: tuple[int, int] | None = None  # the open store's file (device, inode)
        self._retired: list[tuple] = []  # stores (and watches) replaced at their path, closed with the guard
        self._next_reload = 0.0
        #: (authorization as sent, protocol, category, model) -> the plan of
        #: requests that passed the whole check and need no restricted-API header: a repeat costs one
        #: lookup (no bearer parse, no token or category checks), then only what changes per request (the
        #: commit watch, the expiry, the limits). Replaced on every key reload, so a revocation still
        #: takes effect on the very next request.
        self._plans: dict[tuple, tuple] = {}  # -> (principal, take: None or the per-request closure)
        #: (authorization as sent, HTTP path) -> (principal, take, category, model, version, infer): the
        #: HTTP hot path's plan (check_http), the route included (one lookup for both). Replaced with _plans.
        self._http_plans: dict[tuple, tuple] = {}
        self._monotonic = self.clock.monotonic
        #: whether ``time.perf_counter()`` reads the guard's monotonic clock (the system's, where
        #: perf_counter and monotonic are one clock: Linux's CLOCK_MONOTONIC): a transport may then hand
        #: its own read to :meth:`check_http` as ``now`` (one read, not two). False with an injected clock.
        self.now_is_perf_counter = self._monotonic is time.monotonic and (
            time.get_clock_info("perf_counter").implementation == time.get_clock_info("monotonic").implementation)
        self._lock = threading.Lock()
        if settings.auth:
            if settings.key_store is None:
                raise SpecError("--auth needs a key store", field="--key-store",
                                fix="create a key (azulite keys create NAME) or pass --key-store FILE")
            self._store_id = _file_id(settings.key_store)
            self.store = KeyStore(settings.key_store, create=False)
            self._watch = self.store.watch()  # before the first load: a commit in between is seen
            # the hot paths compare the mapped header with the one last seen themselves (CommitWatch.moved
            # only when they differ); unmapped, a value never equal to ``seen`` sends every request there
            self._wal = self._watch.mm if self._watch.mapped else b"\0"
            self._reload()
        self.table: SlotTable | None = None
        if shared_state_dir is None:  # one process: plain dicts, the fastest
            self.buckets = TokenBuckets(self.clock)  # per key id
            self.model_buckets = TokenBuckets(self.clock)  # per model name
            self.quotas = DailyQuotas(self.clock)
        else:  # the server's workers share one file of buckets and quotas (serve/sharedstate.py)
            self.table = SlotTable(Path(shared_state_dir) / LIMITS_FILE)
            self.buckets = SharedTokenBuckets(self.table, "key:", self.clock)
            self.model_buckets = SharedTokenBuckets(self.table, "model:", self.clock)
            self.quotas = SharedDailyQuotas(self.table, "quota:", self.clock)
        self.ledger: QuotaLedger | None = None
        self._ledger_writer: LedgerWriter | None = None
        self._ledger_quotas = self.quotas
        if settings.auth:
            self._open_ledger()
        self.model_rps = dict(settings.model_rps)
        self.headers: dict[str, dict[str, tuple[str, str]]] = {}
        self.admin_categories = set(ADMIN_CATEGORIES)
        for protocol, restrictions in settings.restricted.items():
            for r in restrictions:
                for c in r.categories:
                    self.headers.setdefault(protocol, {})[c] = (r.header, r.value)
                    self.admin_categories.add(c)
        seal = read_key(settings.audit_key) if settings.audit_key else (b"" if settings.audit_seal else None)
        self.audit = (AuditLog(settings.audit_log, max_bytes=settings.audit_max_bytes, backups=settings.audit_backups,
                               shared_lock=Path(shared_state_dir) / "audit.lock" if shared_state_dir else None,
                               seal=seal)
                      if settings.audit_log else None)
        self.rejected: dict[str, int] = {}  # status -> count, for metrics

    def _open_ledger(self) -> None:
        """The day's quota usage as the last run left it, and the thread keeping it (serve/quota_ledger.py).
        A ledger named with --quota-ledger must open; the default one beside the key store may not (a
        read-only Secret volume): then today's quotas start again with the server, said once."""
        path = self.settings.quota_ledger or ledger_path(self.settings.key_store)
        try:
            self.ledger = QuotaLedger(path)
        except KeyStoreError as exc:
            if self.settings.quota_ledger is not None:
                raise SpecError(exc.message, field="--quota-ledger", fix=exc.fix) from None
            log.warning("%s: daily quotas count from this start (pass --quota-ledger FILE on a writable volume)",
                        exc.message)
            return
        day = int(self.clock.time() // 86400)
        for name, used in self.ledger.load(day).items():
            self.quotas.seed(name, day, used)
        # the writer's thread reads the workers' shared counts through a table of its own (sharedstate's
        # SharedDailyQuotas.read); one process's plain counters it reads as they are (whole ints)
        self._ledger_quotas = self.quotas if self.table is None else SharedDailyQuotas(
            SlotTable(self.table.path), "quota:", self.clock)
        self._ledger_writer = LedgerWriter(self.ledger, self._quota_counts)

    def _quota_counts(self) -> tuple[int, list[tuple[str, int]]]:
        """(today, [(key name, requests used today)]) of the keys with a quota (the ledger writer's thread)."""
        day = int(self.clock.time() // 86400)
        counts = []
        for record in list(self._keys.values()):
            if record.quota_per_day:
                used_day, used = self._ledger_quotas.read(record.name)
                if used_day == day:
                    counts.append((record.name, used))
        return day, counts

    def close(self) -> None:
        if self._ledger_writer is not None:
            self._ledger_writer.stop()
            self._ledger_writer = None
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None
            if self._ledger_quotas is not self.quotas:
                self._ledger_quotas.table.close()
        if self.audit is not None:
            self.audit.close()
        for store, watch in [*self._retired, (self.store, self._watch)]:
            if watch is not None:
                self._wal = b"\0"  # its map closes with it
                watch.close()
            if store is not None:
                store.close()
        if self.table is not None:
            self.table.close()

    # --- keys ----------------------------------------------------------------------------------------

    def _reload(self) -> None:
        with self._lock:
            if _file_id(self.settings.key_store) != self._store_id:
                self._reopen()
            if self.store is None:  # gone or unreadable: no key is valid until it is back
                if self._version != _NO_STORE:
                    self._keys, self._verified, self._plans, self._http_plans = {}, {}, {}, {}
                    self._version = _NO_STORE
                return
            version = self.store.data_version()
            if version != self._version:
                self._keys = {r.id: r for r in self.store.records() if r.revoked is None}
                self._verified = {}
                self._plans = {}
                self._http_plans = {}
                self._version = version

    def _reopen(self) -> None:
        """The key store's path names another file now (or none): open that one (under ``_lock``)."""
        path = self.settings.key_store
        self._store_id = _file_id(path)
        retired = (self.store, self._watch)
        try:
            store = KeyStore(path, create=False) if self._store_id is not None else None
        except KeyStoreError as exc:
            log.error("the key store %s cannot be read (%s): every key is refused until it can", path, exc.message)
            store = None
        else:
            if store is None:
                log.error("the key store %s is gone: every key is refused until it is back", path)
            else:
                log.warning("the key store %s was replaced: reopened, its keys read again", path)
        self.store = store
        # unmapped (no store), a value never equal to the watch's ``seen`` sends each request to _reload
        self._watch = store.watch() if store is not None else CommitWatch(None)
        self._wal = self._watch.mm if self._watch.mapped else b"\0"
        self._version = -1
        self._retired.append(retired)  # closed with the guard: a thread may still read the old map now

    def principal(self, token: str | None) -> Principal:
        return self._authenticate(token, self.clock.monotonic(), self.clock.time())[1]

    def _authenticate(self, token: str | None, now: float, wall: float) -> tuple[KeyRecord, Principal]:
        if token is None:
            raise Unauthenticated("this endpoint needs a key", fix="send 'Authorization: Bearer <key>' (gRPC: "
                                  "'authorization' metadata); create one with: azulite keys create NAME")
        if self._watch.moved() or now >= self._next_reload:  # someone committed (or the backstop is due)
            self._next_reload = now + self.settings.reload_interval_s
            self._reload()
        verified = self._verified
        hit = verified.get(token)
        if hit is None:  # a key not seen since the last reload
            parts = split_token(token)
            record = self._keys.get(parts[0]) if parts else None
            if record is None or not check_token(record, parts[1]):
                exc = Unauthenticated("the key is not valid (unknown, revoked or expired)",
                                      fix="use a live key: azulite keys list")
                if record is not None:  # a live key's id with a wrong secret: whose key was tried, for the audit
                    exc.key_id = record.id  # type: ignore[attr-defined]
                raise exc
            hit = (record, Principal(record.id, record.models, record.admin))
            if len(verified) >= 4096:  # only verified keys get here; the bound is for rotations
                verified.clear()
            verified[token] = hit
        expires = hit[0].expires
        if expires is not None and wall >= expires:
            raise Unauthenticated("the key is not valid (unknown, revoked or expired)",
                                  fix="use a live key: azulite keys list")
        return hit

    # --- the check -----------------------------------------------------------------------------------

    def check_request(self, protocol: str, category: str, model: str, authorization: str | bytes | None,
                      headers=None, get_header=None) -> Principal:
        """:meth:`check` for a request as the transport has it: ``authorization`` is the header or metadata
        value as sent (``Bearer <key>``), parsed only the first time it is seen. The hot path of both
        transports: a request like one that passed before (same key, protocol, category and model) is
        answered from ``_plans``."""
        plan = self._plans.get((authorization, protocol, category, model))
        if plan is None:
            return self._check_and_plan(protocol, category, model, authorization, headers, get_header)
        now = self._monotonic()
        watch = self._watch
        if watch is not None and (now >= self._next_reload or self._wal[:WAL_HEADER] != watch.seen) and (
                watch.moved() or now >= self._next_reload):
            self._next_reload = now + self.settings.reload_interval_s
            plans = self._plans
            self._reload()
            if self._plans is not plans:  # the keys changed: this request is checked in full against them
                return self._check_and_plan(protocol, category, model, authorization, headers, get_header)
        take = plan[1]
        if take is None or not take(now):
            return plan[0]
        return self._check_and_plan(protocol, category, model, authorization, headers, get_header)  # expired: refuses

    def check_http(self, authorization: bytes | None, path: str, headers=None, get_header=None,
                   now: float | None = None) -> tuple[Principal, object, str, str, str, bool]:
        """The HTTP transport's one call per request (its hot path): the request, by its ``Authorization``
        value as sent and its path, checked -> ``(principal, -, category, model, version, infer)``; the
        second item is the guard's own, ``infer`` says the path is exactly an infer route of ``model`` (the
        transport may run it without routing the path again). Raises the refusal (ServeError: 401, 403,
        429), counted in :attr:`rejected`. ``now``: the caller's own read of the clock when
        :attr:`now_is_perf_counter` says its ``perf_counter()`` is the guard's clock (None: read here).
        ``get_header(headers, name)`` reads a request header (only when a restricted-API header applies).

        A request like one that passed before (same Authorization value and path) costs one lookup for
        its route and plan together, then what changes per request: the key store's commit watch, the
        key's expiry, the limits. Anything else (a first request, a commit, the reload backstop, an
        expired key) is checked in full (:meth:`check_request`)."""
        hit = self._http_plans.get((authorization, path))
        if hit is not None:
            if now is None:
                now = self._monotonic()
            watch = self._watch
            if watch is not None and (now >= self._next_reload or self._wal[:WAL_HEADER] != watch.seen) and (
                    watch.moved() or now >= self._next_reload):
                self._next_reload = now + self.settings.reload_interval_s
                self._reload()  # a reload that changed the keys replaced _http_plans: checked in full below
                hit = self._http_plans.get((authorization, path))
            if hit is not None:
                take = hit[1]
                if take is None or not take(now):
                    return hit
        category, model, version, infer = http_route_infer(path)
        principal = self.check_request("http", category, model, authorization, headers, get_header)
        plan = self._plans.get((authorization, "http", category, model))
        if plan is not None and plan[0] is principal:
            http_plans = self._http_plans
            if len(http_plans) >= 4096:
                http_plans.clear()
            hit = http_plans[(authorization, path)] = (principal, plan[1], category, model, version, infer)
            return hit
        return principal, None, category, model, version, infer

    def _check_and_plan(self, protocol: str, category: str, model: str, authorization, headers,
                        get_header) -> Principal:
        token = self.token(authorization)
        plans = self._plans  # the reload in check() may replace it: a plan never outlives its keys
        principal = self.check(protocol, category, model, token, headers, get_header)
        if category == OPEN or category in self.headers.get(protocol, ()):
            return principal  # open: nothing to save; a restricted-API header is read on every request
        record = self._verified.get(token, (None,))[0] if token is not None else None
        if self.auth and record is None:
            return principal  # verified by a reload in between: plan it next time
        model_rps = self.model_rps.get(model) if self.model_rps and category == "inference" else None
        quota = record.quota_per_day if record is not None and category == "inference" else None
        limited = record is not None and bool(record.rps or quota)
        local = None
        if self.table is None and (limited or model_rps):  # this process's buckets: drawn from directly
            now, wall = self.clock.monotonic(), self.clock.time()
            local = (self.buckets.bucket(record.name, record.rps, None, now) if limited and record.rps else None,
                     self.quotas.counter(record.name, wall) if limited and quota else None,
                     quota if limited and quota else 0,
                     self.model_buckets.bucket(model, model_rps, None, now) if model_rps else None)
        if len(plans) >= 4096:
            plans.clear()
        expires = record.expires if record is not None else None
        take = (self._take_closure(record if limited else None, model, model_rps, expires, local, bool(quota))
                if limited or model_rps or expires is not None else None)
        plans[(authorization, protocol, category, model)] = (principal, take)
        return principal

    def _take_closure(self, record: KeyRecord | None, model: str, model_rps: float | None, expires: float | None,
                      local: tuple | None, quota: bool):
        """What a planned request still does each time, as one closure over the objects it needs (no
        attribute lookups, no argument unpacking: this runs on every guarded request). ``take(now)``:
        False when granted; True when the key expired (the caller checks in full, which refuses); raises
        the 429 of a limit (counted)."""
        wall_clock = self.clock.time
        rejected = self.rejected
        refusal = self._refusal
        if local is None:  # the workers' shared buckets, under their lock
            limits = self._limits if (record is not None or model_rps) else None

            def take(now: float) -> bool:
                wall = wall_clock()
                if expires is not None and wall >= expires:
                    return True
                if limits is not None:
                    try:
                        limits(record, model, model_rps, now, wall, quota)
                    except ServeError as exc:
                        rejected[exc.status] = rejected.get(exc.status, 0) + 1
                        raise
                return False

            return take
        def refused(which: int, wait: float):
            exc = refusal(which, wait, record, model, model_rps)
            rejected[exc.status] = rejected.get(exc.status, 0) + 1
            raise exc

        return planned_take(*local, wall_clock, expires, refused)

    def token(self, authorization: str | bytes | None) -> str | None:
        """The key a request's Authorization value carries (None without --auth); two of them are refused,
        and counted as every refusal is."""
        if not self.auth:
            return None
        try:
            return bearer(authorization)
        except ServeError as exc:
            self.rejected[exc.status] = self.rejected.get(exc.status, 0) + 1
            raise

    def check(self, protocol: str, category: str, model: str, token: str | None, headers=None,
              get_header=None, *, limits: bool = True) -> Principal:
        """``get_header(headers, name)`` reads a request header / metadata value (or None); only asked
        when a restricted-API header applies. ``limits`` False: the key and its reach only, no bucket or
        quota taken (a gRPC stream opening: its requests are each checked, and counted, as they come)."""
        try:
            return self._check(protocol, category, model, token, headers, get_header, limits)
        except ServeError as exc:
            self.rejected[exc.status] = self.rejected.get(exc.status, 0) + 1
            raise

    def _check(self, protocol: str, category: str, model: str, token: str | None, headers, get_header,
               limits: bool = True) -> Principal:
        if category == OPEN:
            return ANONYMOUS
        restricted = self.headers.get(protocol)
        clock = self.clock
        now, wall = clock.monotonic(), clock.time()  # read once per request: the limits reuse them
        if self.auth:
            record, principal = self._authenticate(token, now, wall)
        else:
            record, principal = None, ANONYMOUS
        if restricted is not None and category in restricted:
            name, value = restricted[category]
            got = get_header(headers, name) if get_header is not None else None
            if got is None or not hmac.compare_digest(got.encode("utf-8", "replace"), value.encode("utf-8", "replace")):
                raise _of(record, PermissionDenied(f"this API is restricted (category {category}), expecting header "
                                                   f"'{name}'", fix=f"send the '{name}' header the server was started with"))
        if record is not None:
            if category in self.admin_categories and not principal.admin:
                raise _of(record, PermissionDenied(f"the {category} API needs an admin key",
                                                   fix="use a key made with: azulite keys create NAME --admin"))
            if model and principal.models is not None and model not in principal.models:
                raise _of(record, PermissionDenied(f"this key does not reach model '{model}'",
                                                   fix="use a key created with --models including it"))
            limited = record.rps or (record.quota_per_day and category == "inference")
        else:
            limited = None
        model_rps = self.model_rps.get(model) if self.model_rps and category == "inference" else None
        if limits and (limited or model_rps):
            self._limits(record, model, model_rps, now, wall, category == "inference")
        return principal

    def _limits(self, record: KeyRecord | None, model: str, model_rps: float | None, now: float,
                wall: float, quota: bool = True) -> None:
        """The key's bucket and quota (``quota``: an inference request, the only kind a quota counts), then
        the model's bucket: in that order, under one lock when the workers share them (one flock pair a
        request), none in one process (the event loop). Buckets and quotas are the key's name's: a rotated
        key (a new id, the same name) goes on with its day's count."""
        lock = self.table.lock if self.table is not None else None
        if lock is not None:
            lock.__enter__()
        try:
            if record is not None and record.rps:
                wait = self.buckets.take_locked(record.name, record.rps, None, now)
                if wait:
                    raise self._refusal(1, wait, record, model, model_rps)
            if quota and record is not None and record.quota_per_day:
                wait = self.quotas.take_locked(record.name, record.quota_per_day, wall)
                if wait:
                    raise self._refusal(2, wait, record, model, model_rps)
            if model_rps:
                wait = self.model_buckets.take_locked(model, model_rps, None, now)
                if wait:
                    raise self._refusal(3, wait, record, model, model_rps)
        finally:
            if lock is not None:
                lock.__exit__(None, None, None)

    @staticmethod
    def _refusal(which: int, wait: float, record: KeyRecord | None, model: str, model_rps: float | None):
        """The 429 of the key's bucket (1), its quota (2) or the model's bucket (3)."""
        if which == 1:
            return _of(record, refuse(f"key '{record.name}' is over its rate limit of {record.rps:g} requests/s",
                                      wait, "slow down, or raise the key's --rps"))
        if which == 2:
            return _of(record, refuse(f"key '{record.name}' used its quota of {record.quota_per_day} requests today "
                                      "(UTC)", wait, "wait for the next UTC day, or raise the key's --quota"))
        return _of(record, refuse(f"model '{model}' is over its rate limit of {model_rps:g} requests/s", wait,
                                  "slow down, or raise --model-rate-limit for this model"))


def visible(principal: Principal, names: Iterable[str]) -> set[str]:
    return {n for n in names if principal.may_see(n)}
