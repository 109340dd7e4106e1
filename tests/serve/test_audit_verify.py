"""Sealed audit logs (``--audit-seal`` / ``--audit-key``): the writer process ends every write with a seal
chaining a hash of its lines to the seal before, across rotated files, restarted writers and every
front-end's writer; ``azulite audit verify`` holds every seal and names the first place one does not: a
line changed, added or removed, a whole write removed, a rotated file removed, lines under no seal, a
write cut short, a chain rewritten without the key."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from azulite.errors import AuditError
from azulite.serve.audit import AuditLog, read_key
from azulite.serve.audit_verify import log_files, verify
from azulite.serve.audit_writer import seal_hash, seal_of

AZULITE = str(Path(sys.executable).parent / "azulite")
KEY = b"k" * 32


def _write(path: Path, n: int, *, seal: bytes | None = b"", every: int = 7, start: int = 0, **kw) -> None:
    """``n`` records, flushed every ``every`` (each flush one write, so one seal), then closed."""
    log = AuditLog(path, seal=seal, batch_s=3600.0, **kw)  # no timer: a write is what a flush hands over
    for i in range(start, start + n):
        log.record(f"r{i}", "k1", "127.0.0.1:5", "m", "1", "http", 200, 0.001, 10, 20)
        if i % every == every - 1:
            assert log.flush()
    log.close()


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _requests(path: Path) -> list[str]:
    return [json.loads(x)["request_id"] for f in log_files(path) for x in _lines(f) if seal_of(x) is None]


def test_a_sealed_log_verifies_across_rotation_and_restarts(tmp_path):
    log = tmp_path / "audit.jsonl"
    _write(log, 60, max_bytes=3000, backups=9)
    _write(log, 40, start=60, max_bytes=3000, backups=9)  # a new server (a new writer) goes on with the chain
    files = log_files(log)
    assert len(files) > 3 and files[-1] == log
    verdict = verify(log)
    assert verdict.ok, (verdict.problem, verdict.where)
    assert verdict.lines == 100 and verdict.seals >= 100 // 7 and verdict.alg == "sha256"
    assert _requests(log) == [f"r{i}" for i in range(100)]
    assert all(p.stat().st_size <= 3000 for p in files)  # the seals fit within max_bytes too
    seals = [seal_of(x) for f in files for x in _lines(f) if seal_of(x) is not None]
    assert seals[0]["prev"] == "" and all(b["prev"] == a["hash"] for a, b in zip(seals, seals[1:]))


def test_an_unsealed_log_is_written_as_before_and_says_it_has_no_seal(tmp_path):
    log = tmp_path / "audit.jsonl"
    _write(log, 10, seal=None)
    assert all(seal_of(x) is None for x in _lines(log)) and len(_lines(log)) == 10
    verdict = verify(log)
    assert not verdict.ok and "no seal" in verdict.problem


def _tamper(log: Path, change) -> object:
    """Apply ``change`` to the file's lines (a list of bytes) and verify."""
    lines = _lines(log)
    log.write_bytes(b"".join(change(lines)))
    return verify(log)


def _request_at(lines: list[bytes], k: int) -> int:
    """The index of the k-th request line (not a seal)."""
    return [i for i, x in enumerate(lines) if seal_of(x) is None][k]


@pytest.mark.parametrize(("change", "problem"), [
    (lambda ls: [x.replace(b'"status":200', b'"status":201', 1) if i == _request_at(ls, 3) else x
                 for i, x in enumerate(ls)], "a line under this seal was changed"),
    (lambda ls: [x for i, x in enumerate(ls) if i != _request_at(ls, 3)], "lines were removed"),
    (lambda ls: ls[:_request_at(ls, 10)] + [ls[_request_at(ls, 10)]] + ls[_request_at(ls, 10):], "lines were added"),
    (lambda ls: ls[:8] + ls[16:], "does not follow the one before it"),  # the 2nd write, its seal too
    (lambda ls: ls[:-1], "after the last seal, under none"),
    (lambda ls: ls[:-1] + [ls[-1][:-5]], "ends within a line"),
])
def test_each_tampering_is_found_and_placed(tmp_path, change, problem):
    log = tmp_path / "audit.jsonl"
    _write(log, 21)  # three writes of 7, each with its seal: lines 1-8, 9-16, 17-24
    assert seal_of(_lines(log)[7]) is not None and seal_of(_lines(log)[15]) is not None
    verdict = _tamper(log, change)
    assert not verdict.ok and problem in verdict.problem, verdict
    assert verdict.where.startswith(str(log)), verdict.where


def test_a_changed_line_is_placed_at_its_write(tmp_path):
    log = tmp_path / "audit.jsonl"
    _write(log, 21)
    verdict = _tamper(log, lambda ls: [x.replace(b'"r10"', b'"rX0"') for x in ls])  # r10: the 2nd write
    assert verdict.where == f"{log} lines 9-16" and "changed" in verdict.problem


def test_a_rotated_file_removed_from_the_middle_breaks_the_chain(tmp_path):
    log = tmp_path / "audit.jsonl"
    _write(log, 60, max_bytes=2500, backups=9)
    assert verify(log).ok and len(log_files(log)) >= 4
    log_files(log)[1].unlink()
    verdict = verify(log)
    assert not verdict.ok and "does not follow" in verdict.problem
    # the oldest files rotation deleted are where the kept log begins: not a break
    for f in log_files(log)[:2]:
        f.unlink()
    assert verify(log).ok


def test_lines_before_sealing_was_on_are_named(tmp_path):
    log = tmp_path / "audit.jsonl"
    _write(log, 5, seal=None)
    _write(log, 7)
    verdict = verify(log)
    assert not verdict.ok and verdict.problem.startswith("5 lines before the chain starts")
    assert verdict.where == f"{log} lines 1-5"


def test_with_a_key_no_one_without_it_can_rewrite_the_chain(tmp_path):
    log = tmp_path / "audit.jsonl"
    _write(log, 14, seal=KEY)
    assert verify(log, KEY).ok and verify(log, KEY).alg == "hmac-sha256"
    with pytest.raises(AuditError, match="sealed with a key"):
        verify(log)
    assert "changed" in verify(log, b"x" * 32).problem  # another key: no seal holds

    # a forger edits a line and recomputes every seal, without the key: each seal says sha256
    lines, prev, pending, out = _lines(log), "", [], []
    for x in lines:
        seal = seal_of(x)
        if seal is None:
            pending.append(x.replace(b'"status":200', b'"status":500'))
            continue
        body = b"".join(pending)
        new = seal_hash(None, prev, body)
        out += [body, json.dumps({"time": 0, "audit_seal": {"alg": "sha256", "lines": len(pending), "prev": prev,
                                                             "hash": new}}).encode() + b"\n"]
        prev, pending = new, []
    log.write_bytes(b"".join(out))
    assert verify(log).ok  # it holds as a keyless chain...
    verdict = verify(log, KEY)  # ...and not under the key
    assert not verdict.ok and "not with the key given" in verdict.problem
    # with alg kept "hmac-sha256" and the keyless hashes, the hash does not hold
    log.write_bytes(log.read_bytes().replace(b'"alg": "sha256"', b'"alg": "hmac-sha256"'))
    assert "changed" in verify(log, KEY).problem


def test_a_writer_killed_and_replaced_goes_on_with_the_chain(tmp_path):
    log = tmp_path / "audit.jsonl"
    audit = AuditLog(log, seal=KEY)
    for i in range(10):
        audit.record(f"r{i}", "k1", "c", "m", "1", "http", 200, 0.001, 1, 2)
    assert audit.flush()
    os.kill(audit._proc.pid, signal.SIGKILL)
    audit._proc.wait()
    for i in range(10, 20):
        audit.record(f"r{i}", "k1", "c", "m", "1", "http", 200, 0.001, 1, 2)
    assert audit.flush()  # a new writer process, which reads the last seal from the log
    audit.close()
    verdict = verify(log, KEY)
    assert verdict.ok and verdict.lines == 20, verdict


def test_two_writers_of_one_log_under_its_lock_keep_one_chain(tmp_path):
    """Every front-end of `--workers N` has its own writer process; they share the log under a lock."""
    log, lock = tmp_path / "audit.jsonl", tmp_path / "audit.lock"
    a = AuditLog(log, seal=KEY, shared_lock=lock, max_bytes=4000)
    b = AuditLog(log, seal=KEY, shared_lock=lock, max_bytes=4000)
    for i in range(60):
        (a if i % 2 else b).record(f"r{i}", "k1", "c", "m", "1", "http", 200, 0.001, 1, 2)
        if i % 5 == 4:
            assert a.flush() and b.flush()
    a.close()
    b.close()
    verdict = verify(log, KEY)
    assert verdict.ok and verdict.lines == 60, verdict
    assert sorted(_requests(log)) == sorted(f"r{i}" for i in range(60))


def test_a_short_or_missing_key_is_refused_naming_it(tmp_path):
    short = tmp_path / "short.key"
    short.write_bytes(b"x" * 15)
    with pytest.raises(AuditError, match="15 bytes; at least 16"):
        read_key(short)
    with pytest.raises(AuditError, match="cannot read the seal key") as e:
        read_key(tmp_path / "none.key")
    assert "head -c 32 /dev/urandom" in e.value.fix


def test_the_cli_verifies_a_served_logs_chain_and_exits_1_at_a_break(tmp_path):
    """A real `azulite serve --workers 2` with --audit-key: both front-ends' writers seal one log."""
    import http.client

    from tests.serve.conftest import build_model_repository
    from tests.serve.test_workers import Workers

    key = tmp_path / "audit.key"
    key.write_bytes(os.urandom(32))
    log = tmp_path / "audit.jsonl"
    root = build_model_repository(tmp_path / "repo", ("add_sub_py",))
    s = Workers(root, "--audit-log", str(log), "--audit-key", str(key))
    body = json.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 16], "data": list(range(16))}
                                  for n in ("INPUT0", "INPUT1")]})
    try:
        for pid in s.frontends():
            c = s.conn_on(pid)
            for _ in range(5):
                c.request("POST", "/v2/models/add_sub_py/infer", body=body, headers={"Content-Type": "application/json"})
                r = c.getresponse()
                assert isinstance(r, http.client.HTTPResponse) and r.status == 200
                r.read()
            c.close()
    finally:
        s.stop()
    assert len([x for x in _requests(log) if x]) >= 10

    def run(*args):
        return subprocess.run([AZULITE, "audit", "verify", *args], capture_output=True, text=True, timeout=120)

    ok = run(str(log), "--key", str(key))
    assert ok.returncode == 0 and "the chain holds" in ok.stdout and "(hmac-sha256)" in ok.stdout, ok.stdout + ok.stderr
    doc = json.loads(run(str(log), "--key", str(key), "--json").stdout)
    assert doc["ok"] and doc["lines"] >= 10 and doc["seals"] >= 1
    nokey = run(str(log))
    assert nokey.returncode == 2 and "sealed with a key" in nokey.stderr and "--key FILE" in nokey.stderr
    lines = _lines(log)
    victim = next(i for i, x in enumerate(lines) if b'"model":"add_sub_py"' in x)
    lines[victim] = lines[victim].replace(b'"status":200', b'"status":404')
    log.write_bytes(b"".join(lines))
    bad = run(str(log), "--key", str(key))
    assert bad.returncode == 1 and "a line under this seal was changed" in bad.stderr
    assert f"{log} line" in bad.stderr and "Traceback" not in bad.stderr
    missing = run(str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "no audit log here" in missing.stderr
