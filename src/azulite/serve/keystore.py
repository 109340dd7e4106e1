"""Endpoint keys in SQLite: what ``azulite keys`` writes and ``azulite serve --auth`` reads.

A key's secret is shown once (``azk_<id>_<secret>``) and only ``sha256(salt || secret)`` is stored. A
fast salted hash and not a password KDF (scrypt, argon2) on purpose: the secret is 32 random bytes, so
no dictionary or brute force reaches it, and the server checks a key on every request (a KDF would cost
tens of milliseconds each). The id in front of the secret names the row to compare with, in constant
time (``hmac.compare_digest``).

The store is one SQLite file (WAL) so that several processes read one truth: the CLI revokes, a running
server sees it on its next request (:class:`CommitWatch` notices any commit, then ``PRAGMA data_version``
confirms it and the keys are reloaded), and every worker process of a server shares it unchanged. Rate
figures live here too; live rate buckets do not (ratelimit.py, sharedstate.py).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import mmap
import os
import re
import secrets
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from azulite.errors import KeyStoreError
from azulite.sqlite_wal import create_private, open_wal

PREFIX = "azk_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    salt BLOB NOT NULL,
    hash BLOB NOT NULL,
    models TEXT,              -- comma-separated model names; NULL: every model
    rps REAL,                -- requests per second; NULL: unlimited
    quota_per_day INTEGER,   -- requests per UTC day; NULL: unlimited
    admin INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    expires REAL,            -- unix time; NULL: never
    revoked REAL             -- unix time of revocation; NULL: live
);
CREATE INDEX IF NOT EXISTS keys_name ON keys(name);
"""


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One key as stored (never the secret). ``models`` None: every model."""

    id: str
    name: str
    models: frozenset[str] | None
    rps: float | None
    quota_per_day: int | None
    admin: bool
    created: float
    expires: float | None
    revoked: float | None
    salt: bytes = b""
    digest: bytes = b""

    def live(self, now: float) -> bool:
        return self.revoked is None and (self.expires is None or now < self.expires)

    def public(self) -> dict:
        """What ``keys list --json`` shows."""
        iso = lambda t: None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat()  # noqa: E731
        return {"id": self.id, "name": self.name, "models": sorted(self.models) if self.models is not None else None,
                "rps": self.rps, "quota_per_day": self.quota_per_day, "admin": self.admin,
                "created": iso(self.created), "expires": iso(self.expires), "revoked": iso(self.revoked)}


def digest(salt: bytes, secret: str) -> bytes:
    return hashlib.sha256(salt + secret.encode()).digest()


def split_token(token: str) -> tuple[str, str] | None:
    """``azk_<id>_<secret>`` -> (id, secret); None when it is not shaped like one of ours."""
    if not token.startswith(PREFIX):
        return None
    key_id, sep, secret = token[len(PREFIX):].partition("_")
    if not sep or not key_id or not secret:
        return None
    return key_id, secret


def parse_expiry(text: str) -> float:
    """``2027-01-31`` or an ISO time (UTC unless it says otherwise) -> unix time."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise KeyStoreError(f"--expires {text!r} is not a date", fix="give a date such as 2027-01-31 "
                            "or a time such as 2027-01-31T12:00:00+00:00") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


MAX_QUOTA = 10**12  #: requests a day; more is no quota at all (and SQLite keeps 64-bit integers)


def parse_quota(text: str) -> int:
    """``1000/day`` or ``1000`` -> 1000 requests per UTC day."""
    number = text.strip().lower().removesuffix("/day").strip()
    if number.isdigit() and int(number) == 0:
        raise KeyStoreError(f"--quota {text!r} must be at least 1 request a day",
                            fix="e.g. --quota 10000/day, or omit --quota for no daily quota")
    if not number.isdigit():
        raise KeyStoreError(f"--quota {text!r} is not a daily quota", fix="give a whole number of requests "
                            "per UTC day, e.g. --quota 10000/day")
    if int(number) > MAX_QUOTA:  # SQLite's INTEGER is 64-bit: past it, an OverflowError's traceback
        raise KeyStoreError(f"--quota {text!r} is more than {MAX_QUOTA} requests a day",
                            fix="give at most 1000000000000/day, or omit --quota for no daily quota")
    return int(number)


def check_key(name: str, *, rps: float | None = None, quota_per_day: int | None = None,
              expires: float | None = None, now: float | None = None, expires_as_typed: str | None = None) -> None:
    """What a new key may be: a valid name, a finite positive rate, a quota of at least one request a day,
    an expiry in the future (named as the user typed it, when given). KeyStore.create checks with it; the
    CLI calls it first, so a refused key does not create the store."""
    if not _NAME.match(name):
        raise KeyStoreError(f"key name {name!r} is not valid",
                            fix="use letters, digits, '.', '_' or '-' (at most 64), e.g. team-a")
    if rps is not None and not (math.isfinite(rps) and rps > 0):
        raise KeyStoreError(f"--rps {rps:g} is not a positive rate",
                            fix="give requests per second above 0, e.g. --rps 50, or omit --rps for no rate limit")
    if quota_per_day is not None and not 1 <= quota_per_day <= MAX_QUOTA:
        raise KeyStoreError(f"--quota {quota_per_day} must be 1 to {MAX_QUOTA} requests a day",
                            fix="e.g. --quota 10000/day, or omit --quota for no daily quota")
    now = time.time() if now is None else now
    if expires is not None and expires <= now:
        when = expires_as_typed or datetime.fromtimestamp(expires, timezone.utc).isoformat()
        today = datetime.fromtimestamp(now, timezone.utc)
        raise KeyStoreError(f"--expires {when} is in the past (now: {today:%Y-%m-%d %H:%M} UTC)",
                            fix=f"give a future date, e.g. --expires {today + timedelta(days=90):%Y-%m-%d}")


class KeyStore:
    """Opens (and creates) the SQLite file. Every method is one short transaction; safe from several
    processes at once (WAL, busy timeout)."""

    def __init__(self, path: Path | str, *, create: bool = True) -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise KeyStoreError(f"key store {str(self.path)!r} does not exist",
                                fix="create a key first: azulite keys create NAME (or pass the right --key-store)")
        try:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # was FileNotFoundError's traceback (/proc/nope/keys.db)
                raise KeyStoreError(f"key store {str(self.path)!r}: its folder cannot be made: {exc.strerror or exc}",
                                    fix="point --key-store at a file in a folder this user can write") from None
            create_private(self.path)  # key hashes and names: its owner's only (0600)
            # a fresh file several `keys create` open at once: sqlite_wal.py retries the switch SQLite refuses
            self._db, self.journal_mode = open_wal(
                lambda: sqlite3.connect(str(self.path), timeout=30, isolation_level=None, check_same_thread=False),
                _SCHEMA, retry_s=30.0)
            self._db.execute("SELECT id, name, salt, hash, models, rps, quota_per_day, admin, created, expires, "
                             "revoked FROM keys LIMIT 1").fetchall()
        except sqlite3.Error as exc:
            raise KeyStoreError(f"key store {str(self.path)!r} cannot be used: {exc}",
                                fix="point --key-store at an azulite key store, or move the broken file away "
                                "and create keys again") from None

    def close(self) -> None:
        self._db.close()

    def data_version(self) -> int:
        """Changes whenever another connection commits (a read transaction: ~1.8 µs; per request, ask
        :meth:`watch` first)."""
        return self._db.execute("PRAGMA data_version").fetchone()[0]

    def watch(self) -> "CommitWatch":
        """A per-request test of whether anything may have been committed since the last look."""
        return CommitWatch(self.path if self.journal_mode == "wal" else None)

    def create(self, name: str, *, models: Iterable[str] | None = None, rps: float | None = None,
               quota_per_day: int | None = None, admin: bool = False, expires: float | None = None,
               now: float | None = None) -> tuple[KeyRecord, str]:
        """A new key; returns its record and the token (shown once, never stored). A name a live key has is
        refused: `keys revoke NAME` revokes every live key of a name, so two of one name would go together."""
        now = time.time() if now is None else now
        check_key(name, rps=rps, quota_per_day=quota_per_day, expires=expires, now=now)
        self._db.execute("BEGIN IMMEDIATE")  # the check and the insert as one: two shells creating at once
        try:
            if self._db.execute("SELECT 1 FROM keys WHERE name = ? AND revoked IS NULL", (name,)).fetchone():
                raise KeyStoreError(f"a live key is already named {name!r} in {self.path}",
                                    fix=f"rotate it (azulite keys rotate {name}), revoke it first, or pick another name")
            created = self._insert(name, models, rps, quota_per_day, admin, expires, now)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return created

    def _insert(self, name: str, models: Iterable[str] | None, rps: float | None, quota_per_day: int | None,
                admin: bool, expires: float | None, now: float) -> tuple[KeyRecord, str]:
        model_list = sorted(set(models)) if models else None
        key_id, secret, salt = secrets.token_hex(6), secrets.token_urlsafe(32), secrets.token_bytes(16)
        self._db.execute(
            "INSERT INTO keys (id, name, salt, hash, models, rps, quota_per_day, admin, created, expires) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (key_id, name, salt, digest(salt, secret), ",".join(model_list) if model_list else None, rps,
             quota_per_day, int(admin), now, expires))
        return self.get(key_id), f"{PREFIX}{key_id}_{secret}"

    @staticmethod
    def _record(row) -> KeyRecord:
        key_id, name, salt, hashed, models, rps, quota, admin, created, expires, revoked = row
        return KeyRecord(id=key_id, name=name, models=frozenset(models.split(",")) if models else None, rps=rps,
                         quota_per_day=quota, admin=bool(admin), created=created, expires=expires, revoked=revoked,
                         salt=bytes(salt), digest=bytes(hashed))

    _COLUMNS = "id, name, salt, hash, models, rps, quota_per_day, admin, created, expires, revoked"

    def get(self, key_id: str) -> KeyRecord:
        row = self._db.execute(f"SELECT {self._COLUMNS} FROM keys WHERE id = ?", (key_id,)).fetchone()
        if row is None:
            raise KeyStoreError(f"no key with id {key_id!r} in {self.path}")
        return self._record(row)

    def records(self) -> list[KeyRecord]:
        rows = self._db.execute(f"SELECT {self._COLUMNS} FROM keys ORDER BY created, id").fetchall()
        return [self._record(r) for r in rows]

    def find(self, name_or_id: str) -> list[KeyRecord]:
        """Live keys named so, or the one key with that id."""
        rows = self._db.execute(f"SELECT {self._COLUMNS} FROM keys WHERE (name = ? OR id = ?) AND revoked IS NULL",
                                (name_or_id, name_or_id)).fetchall()
        if not rows:
            raise KeyStoreError(f"no live key named {name_or_id!r} in {self.path}",
                                fix="see the keys with: azulite keys list")
        return [self._record(r) for r in rows]

    def revoke(self, name_or_id: str, *, now: float | None = None) -> list[KeyRecord]:
        found = self.find(name_or_id)
        now = time.time() if now is None else now
        self._db.executemany("UPDATE keys SET revoked = ? WHERE id = ?", [(now, r.id) for r in found])
        return found

    def rotate(self, name_or_id: str, *, now: float | None = None) -> tuple[KeyRecord, str]:
        """A new secret with the same name, models and limits; the old key is revoked in the same
        transaction (clients switch over to the new token)."""
        found = self.find(name_or_id)
        if len(found) > 1:
            raise KeyStoreError(f"{len(found)} live keys are named {name_or_id!r}",
                                fix="rotate one by its id (azulite keys list)")
        old = found[0]
        now = time.time() if now is None else now
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute("UPDATE keys SET revoked = ? WHERE id = ?", (now, old.id))
            record, token = self._insert(old.name, old.models, old.rps, old.quota_per_day, old.admin, old.expires, now)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return record, token


def check_token(record: KeyRecord, secret: str) -> bool:
    return hmac.compare_digest(record.digest, digest(record.salt, secret))


WAL_HEADER = 48  # the first copy of the WAL-index header (sqlite.org/walformat.html, "the WAL-index header")


class CommitWatch:
    """Whether another connection may have committed since the last :meth:`moved` — read from the
    SQLite WAL-index (the ``-shm`` file every connection to the store maps): its header holds a counter
    every write transaction increments, so a commit by the CLI in another process is visible here before
    its ``revoke()`` returns. Reading 48 mapped bytes costs ~0.07 µs where ``PRAGMA data_version`` (the
    authority, asked when the header moved) costs ~1.8 µs a request: what lets a revocation take effect
    on the very next request with nothing on the request path but a compare.

    The format is SQLite's documented, cross-version one (processes of different SQLite versions share
    it). A false alarm (a checkpoint also rewrites the header) only costs one ``data_version``; when the
    store is not in WAL mode or the file cannot be mapped, :meth:`moved` always answers True (ask SQLite
    every request: correct, slower)."""

    #: ``mm``: the mapped header (None when unmapped); ``seen``: the header as :meth:`moved` last read it. A
    #: hot path may compare ``mm[:48] != seen`` itself (one frame less) and call :meth:`moved` when they differ
    __slots__ = ("mm", "seen")

    def __init__(self, store_path: Path | None) -> None:
        self.mm: mmap.mmap | None = None
        if store_path is not None:
            try:
                fd = os.open(f"{store_path}-shm", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    self.mm = mmap.mmap(fd, WAL_HEADER, access=mmap.ACCESS_READ)
                finally:
                    os.close(fd)
            except (OSError, ValueError):  # gone, or shorter than the header: SQLite answers instead
                self.mm = None
        self.seen = self.mm[:WAL_HEADER] if self.mm is not None else b""

    @property
    def mapped(self) -> bool:
        return self.mm is not None

    def moved(self) -> bool:
        mm = self.mm
        if mm is None:
            return True
        head = mm[:WAL_HEADER]
        if head == self.seen:
            return False
        self.seen = head  # before the caller reloads: a commit after this read moves it again
        return True

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
            self.mm = None
