"""One truth across processes (ServerSettings.shared_state_dir): real worker processes, each building its
own Guard / OutputMonitor on the same directory, share the rate buckets, daily quotas and drift windows.
Time is each process's injected clock, set by the test (no wall time): a key limited to R requests/s
gets R in total, not R per process; a quota of Q a day is Q in total and survives a worker's restart;
the drift windows hold every process's values."""

from __future__ import annotations

import json
import multiprocessing as mp

import numpy as np
import pytest

from azulite.errors import ResourceExhausted, SpecError
from azulite.serve.audit import AuditLog
from azulite.serve.auth import Guard, GuardSettings
from azulite.serve.drift import OutputMonitor
from azulite.serve.keystore import KeyStore
from azulite.serve.sharedstate import PROBE, SharedDriftStore, SharedTokenBuckets, SlotTable

T0 = 1_000_000.0


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return self.t


def _worker(conn, state_dir: str, key_store: str) -> None:
    """Serve the test's commands: ("at", t) sets the clock; ("check", token, model, n) runs n guard
    checks and answers how many passed; ("observe", values) feeds the drift monitor; ("figures",)."""
    clock = Clock()
    guard = Guard(GuardSettings(auth=True, key_store=key_store, model_rps=(("m", 4.0),)), clock=clock,
                  shared_state_dir=state_dir)
    monitor = OutputMonitor(20, per_request=100, shared=SharedDriftStore(state_dir, "model-m"))
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "at":
            clock.t = cmd[1]
            conn.send(None)
        elif cmd[0] == "check":
            _, token, model, n = cmd
            ok = 0
            for _ in range(n):
                try:
                    guard.check("http", "inference", model, token)
                    ok += 1
                except ResourceExhausted:
                    pass
            conn.send(ok)
        elif cmd[0] == "observe":
            monitor.observe([("OUT", np.asarray(cmd[1], dtype=np.float32))])
            conn.send(None)
        elif cmd[0] == "figures":
            conn.send([(f.output, f.psi, f.ks, f.reference, f.current) for f in monitor.figures()])
        else:
            guard.close()
            conn.send(None)
            return


class Workers:
    def __init__(self, state_dir, key_store, n: int) -> None:
        self.args = (str(state_dir), str(key_store))
        self.ctx = mp.get_context("spawn")
        self.procs: list = []
        self.conns: list = []
        for _ in range(n):
            self.start()
        for c in self.conns:
            assert c.recv() == "ready"  # the safety net is the test's timeout

    def start(self) -> int:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, args=(child, *self.args), daemon=True)
        p.start()
        self.procs.append(p)
        self.conns.append(parent)
        return len(self.conns) - 1

    def all(self, *cmd) -> list:
        """The command to every worker at once (they run it concurrently), then their answers."""
        live = [c for c in self.conns if c is not None]
        for c in live:
            c.send(cmd)
        return [c.recv() for c in live]

    def one(self, i: int, *cmd):
        self.conns[i].send(cmd)
        return self.conns[i].recv()

    def stop(self, i: int) -> None:
        self.one(i, "stop")
        self.procs[i].join(30)
        assert self.procs[i].exitcode == 0
        self.conns[i] = None

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(30)


@pytest.fixture
def keys(tmp_path):
    store = KeyStore(tmp_path / "keys.db")
    out = {"path": tmp_path / "keys.db",
           "rate": store.create("rate", rps=10.0)[1],
           "quota": store.create("quota", quota_per_day=7)[1],
           "free": store.create("free")[1]}
    store.close()
    return out


def test_limits_and_quotas_hold_in_total_across_processes(tmp_path, keys):
    w = Workers(tmp_path / "state", keys["path"], 3)
    try:
        # rate: a burst of 10, 3 processes asking 10 each at the same instant -> 10 in all, not 30
        assert sum(w.all("check", keys["rate"], "x", 10)) == 10
        w.all("at", T0 + 0.5)  # half a second: 5 tokens for everyone together
        assert sum(w.all("check", keys["rate"], "x", 10)) == 5
        # the per-model bucket (4/s, all keys together) is shared too
        assert sum(w.all("check", keys["free"], "m", 4)) == 4
        # quota: 7 a day in total
        assert sum(w.all("check", keys["quota"], "x", 5)) == 7
        # a worker restarted (a new process, a new Guard) does not get a fresh quota
        w.stop(0)
        i = w.start()
        assert w.conns[i].recv() == "ready"
        w.one(i, "at", T0 + 0.5)
        assert w.one(i, "check", keys["quota"], "x", 5) == 0
        assert w.one(i, "check", keys["rate"], "x", 5) == 0  # its bucket is the others' too: still empty
        w.all("at", T0 + 86400)  # the next UTC day (the clock's day starts at a multiple of 86400)
        assert sum(w.all("check", keys["quota"], "x", 5)) == 7
    finally:
        w.close()


def test_drift_windows_merge_across_processes(tmp_path, keys):
    w = Workers(tmp_path / "state", keys["path"], 2)
    try:
        alone = OutputMonitor(20, per_request=100)  # what one process seeing every value would say
        feeds = [(0, np.arange(0, 10)), (1, np.arange(10, 20)),  # the reference: half from each process
                 (0, np.arange(5, 15) + 0.5), (1, np.arange(40, 50))]  # the current window: both again
        for i, values in feeds:
            w.one(i, "observe", values.tolist())
            alone.observe([("OUT", values.astype(np.float32))])
        expected = [(f.output, f.psi, f.ks, f.reference, f.current) for f in alone.figures()]
        assert expected and expected[0][3:] == (20, 20)
        assert w.all("figures") == [expected, expected]  # each process reports the windows of both
    finally:
        w.close()


def test_in_process_guard_keeps_plain_buckets(tmp_path, keys):
    guard = Guard(GuardSettings(auth=True, key_store=keys["path"]), clock=Clock())
    assert guard.table is None and not (tmp_path / "limits.bin").exists()
    assert sum(guard.check("http", "inference", "x", keys["rate"]) is not None
               for _ in range(10)) == 10
    with pytest.raises(ResourceExhausted):
        guard.check("http", "inference", "x", keys["rate"])
    guard.close()


def test_full_probe_window_evicts_the_stalest_slot(tmp_path):
    table = SlotTable(tmp_path / "limits.bin", slots=PROBE)  # every name shares one probe window
    clock = Clock()
    buckets = SharedTokenBuckets(table, "key:", clock)
    for i in range(PROBE):
        clock.t = T0 + i
        assert buckets.take(f"k{i}", 0.001) == 0.0  # a burst of 1, then one token each 1000 s
    clock.t = T0 + PROBE
    assert buckets.take("k1", 0.001) > 0.0  # spent, and kept
    assert buckets.take("new", 0.001) == 0.0  # a fresh bucket, in the stalest slot (k0's)
    assert buckets.take("k3", 0.001) > 0.0  # the others keep their state
    assert buckets.take("k0", 0.001) == 0.0  # k0 was evicted: it starts afresh
    table.close()


def test_a_foreign_file_is_refused_naming_it(tmp_path):
    bad = tmp_path / "limits.bin"
    bad.write_bytes(b"not ours" * 100)
    with pytest.raises(SpecError, match="limits.bin"):
        SlotTable(bad)


def _audit_writer(path: str, lock: str, worker: int, n: int, start) -> None:
    log = AuditLog(path, max_bytes=4000, backups=100, shared_lock=lock, batch_s=0.001)
    start.wait()
    for i in range(n):
        log.record(f"w{worker}-{i}", None, "client", "m", "1", "http", 200, 0.001, 10, 20)
        if i % 25 == 0:
            log.flush()  # many small batches: many chances to interleave and to rotate under the other
    log.close()


def test_audit_log_written_by_several_processes_keeps_every_line_whole(tmp_path):
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    path, lock = tmp_path / "audit.jsonl", tmp_path / "state" / "audit.lock"
    procs = [ctx.Process(target=_audit_writer, args=(str(path), str(lock), w, 300, start)) for w in range(2)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    files = sorted(tmp_path.glob("audit.jsonl*"))
    assert len(files) > 10  # it rotated many times, with both writing
    ids = []
    for f in files:
        text = f.read_text()
        assert len(text.encode()) <= 4000, f
        ids += [json.loads(line)["request_id"] for line in text.splitlines()]  # every line whole JSON
    assert sorted(ids) == sorted(f"w{w}-{i}" for w in range(2) for i in range(300))  # none lost or doubled
