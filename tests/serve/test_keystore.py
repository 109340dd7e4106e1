"""The key store: secrets shown once and stored only hashed, revocation, rotation, bad files named."""

from __future__ import annotations

import sqlite3

import pytest

from azulite.errors import KeyStoreError
from azulite.serve.keystore import CommitWatch, KeyStore, check_token, parse_expiry, parse_quota, split_token
from tests.test_sqlite_wal import opened_at_once


def test_create_stores_only_a_salted_hash(tmp_path):
    store = KeyStore(tmp_path / "keys.db")
    record, token = store.create("team-a", models=["m2", "m1"], rps=5, quota_per_day=100)
    key_id, secret = split_token(token)
    assert key_id == record.id and record.models == frozenset({"m1", "m2"})
    raw = (tmp_path / "keys.db").read_bytes() + b"".join(
        p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("keys.db-"))
    assert secret.encode() not in raw
    assert check_token(store.get(key_id), secret)
    assert not check_token(store.get(key_id), secret[:-1] + ("A" if secret[-1] != "A" else "B"))


def test_two_keys_with_one_secret_length_differ_by_salt(tmp_path):
    store = KeyStore(tmp_path / "keys.db")
    a, _ = store.create("a")
    b, _ = store.create("b")
    assert a.salt != b.salt and a.digest != b.digest


def test_revoke_and_rotate(tmp_path):
    store = KeyStore(tmp_path / "keys.db")
    old, _ = store.create("svc", models=["m"], rps=3, admin=True)
    new, token = store.rotate("svc")
    assert new.id != old.id and (new.models, new.rps, new.admin) == (old.models, old.rps, old.admin)
    assert store.get(old.id).revoked is not None and store.get(new.id).revoked is None
    assert split_token(token)[0] == new.id
    before = store.data_version()
    other = KeyStore(tmp_path / "keys.db")  # another process's connection (the CLI)
    other.revoke("svc")
    assert store.data_version() != before  # what a running server watches
    with pytest.raises(KeyStoreError, match="no live key named 'svc'"):
        store.revoke("svc")


def test_a_name_a_live_key_has_is_refused_and_free_again_once_revoked(tmp_path):
    # two live keys of one name: `keys revoke NAME` (every live key of that name) cut off both
    store = KeyStore(tmp_path / "keys.db")
    first, _ = store.create("team-a")
    with pytest.raises(KeyStoreError, match="a live key is already named 'team-a'") as info:
        store.create("team-a")
    assert "azulite keys rotate team-a" in info.value.fix
    assert [r.id for r in store.find("team-a")] == [first.id]  # nothing was written
    store.revoke("team-a")
    again, _ = store.create("team-a")
    assert [r.id for r in store.find("team-a")] == [again.id]


def test_bad_inputs_are_named(tmp_path):
    store = KeyStore(tmp_path / "keys.db")
    with pytest.raises(KeyStoreError, match="key name"):
        store.create("no spaces")
    with pytest.raises(KeyStoreError, match="--rps"):
        store.create("a", rps=0)
    with pytest.raises(KeyStoreError, match="past"):
        store.create("a", expires=1.0)
    with pytest.raises(KeyStoreError, match="quota"):
        parse_quota("ten/day")
    assert parse_quota("10000/day") == 10000
    with pytest.raises(KeyStoreError, match="not a date"):
        parse_expiry("tomorrow")
    assert parse_expiry("1970-01-02") == 86400.0
    assert split_token("Bearer x") is None and split_token("azk_abc") is None


def test_a_broken_store_names_the_file(tmp_path):
    bad = tmp_path / "keys.db"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(KeyStoreError, match="keys.db"):
        KeyStore(bad)
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE keys (x)").connection.commit()
    with pytest.raises(KeyStoreError, match="other.db"):
        KeyStore(other)
    with pytest.raises(KeyStoreError, match="does not exist"):
        KeyStore(tmp_path / "missing.db", create=False)


def test_commit_watch_sees_every_commit_of_another_connection_and_nothing_else(tmp_path):
    store = KeyStore(tmp_path / "keys.db")
    watch = store.watch()
    assert watch.mapped and not watch.moved()
    other = KeyStore(tmp_path / "keys.db")  # another process's connection (the CLI)
    record, _ = other.create("a")
    assert watch.moved() and not watch.moved()  # once per change
    store.records()
    other.records()
    assert not watch.moved()  # reads commit nothing: no reload is asked for in steady state
    other.revoke(record.id)
    assert watch.moved()
    watch.close()
    other.close()
    store.close()


def test_commit_watch_without_a_wal_index_always_answers_moved(tmp_path):
    for watch in (CommitWatch(None), CommitWatch(tmp_path / "no-such.db")):
        assert not watch.mapped and watch.moved() and watch.moved()


def _new_store(path: str) -> None:
    KeyStore(path).close()


def test_a_fresh_key_store_opened_by_several_processes_at_once_opens_for_all(tmp_path):
    """Several `azulite keys create` into a new store at once: SQLite refused the switch to WAL with "database
    is locked" in 24 of 100 rounds of 6 before sqlite_wal.py retried it."""
    opened_at_once(tmp_path, _new_store, 20)


def test_the_store_and_its_sqlite_files_are_its_owners_only(tmp_path):
    """Key hashes, names and ids: under umask 022 the store was readable by every local user."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        store = KeyStore(tmp_path / "keys.db")
        store.create("team")
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
        store.close()
    finally:
        os.umask(old)
    assert modes["keys.db"] == 0o600 and all(m & 0o077 == 0 for m in modes.values()), modes
