"""The day's quota usage outlives the server (serve/quota_ledger.py): a guard started again, in one process or
as workers sharing their slot file, goes on from the day's count; a rotated key (a new id, the same name)
too; only inference requests count; a new UTC day starts from zero; the ledger keeps the larger count."""

from __future__ import annotations

import pytest

from azulite.errors import ResourceExhausted, SpecError
from azulite.serve.auth import Guard, GuardSettings
from azulite.serve.keystore import KeyStore
from azulite.serve.quota_ledger import QuotaLedger, ledger_path

DAY = 86400.0


class Clock:
    def __init__(self) -> None:
        self.now, self.wall = 1000.0, 20_000 * DAY + 3600.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.wall


def infer(guard: Guard, token: str) -> bool:
    try:
        guard.check("http", "inference", "m", token)
    except ResourceExhausted:
        return False
    return True


@pytest.mark.parametrize("shared", [False, True])
def test_a_restarted_guard_goes_on_from_the_days_count(tmp_path, shared):
    store = KeyStore(tmp_path / "keys.db")
    _, token = store.create("team", quota_per_day=5)
    clock = Clock()

    def guard(run: int) -> Guard:  # the workers' slot file is the run's own (a restart makes a new one)
        return Guard(GuardSettings(auth=True, key_store=store.path), clock=clock,
                     shared_state_dir=(tmp_path / f"run{run}") if shared else None)

    if shared:
        for run in (1, 2, 3):
            (tmp_path / f"run{run}").mkdir()
    first = guard(1)
    assert [infer(first, token) for _ in range(3)] == [True] * 3
    assert all(first.check("http", "metadata", "", token) for _ in range(10))  # metadata does not count
    first.close()  # writes the counts
    second = guard(2)
    assert [infer(second, token) for _ in range(3)] == [True, True, False]  # 3 + 2 = the day's 5
    second.close()
    clock.wall += DAY  # the next UTC day
    third = guard(3)
    assert [infer(third, token) for _ in range(6)] == [True] * 5 + [False]
    third.close()
    store.close()


def test_a_rotated_key_keeps_its_days_count(tmp_path):
    store = KeyStore(tmp_path / "keys.db")
    _, token = store.create("team", quota_per_day=3)
    guard = Guard(GuardSettings(auth=True, key_store=store.path), clock=Clock())
    try:
        assert [infer(guard, token) for _ in range(3)] == [True] * 3
        _, rotated = store.rotate("team")
        assert infer(guard, rotated) is False  # "same name, models and limits": the day's count too
    finally:
        guard.close()
        store.close()


def test_the_ledger_keeps_the_larger_count_and_drops_old_days(tmp_path):
    ledger = QuotaLedger(tmp_path / "usage.db")
    ledger.save(10, [("a", 5), ("b", 1)])
    ledger.save(10, [("a", 3)])  # a worker that saw less writes after one that saw more
    ledger.save(7, [("a", 9)])
    assert ledger.load(10) == {"a": 5, "b": 1}
    assert ledger.load(7) == {}  # days before yesterday are gone once a later day is loaded
    ledger.close()


def test_the_ledger_lies_beside_the_store_and_a_named_one_must_open(tmp_path):
    store = KeyStore(tmp_path / "keys.db")
    store.create("team", quota_per_day=3)
    Guard(GuardSettings(auth=True, key_store=store.path), clock=Clock()).close()
    assert ledger_path(store.path).is_file() and ledger_path(store.path).name == "keys.db.usage"
    (tmp_path / "afile").write_text("")
    with pytest.raises(SpecError, match="quota ledger") as info:
        Guard(GuardSettings(auth=True, key_store=store.path, quota_ledger=tmp_path / "afile" / "usage.db"),
              clock=Clock())
    assert info.value.field == "--quota-ledger"
    store.close()
