"""The audit log: one JSON line per request off the request path, rotation by size, a failing disk
counted and never raised."""

from __future__ import annotations

import json

from azulite.serve.audit import FIELDS, AuditLog


def _record(log: AuditLog, i: int) -> None:
    log.record(request_id=f"r{i}", key_id="k1", client="127.0.0.1:5", model="m", version="1", protocol="http",
               status=200, latency_s=0.001, bytes_in=10, bytes_out=20)


def test_lines_hold_every_field_and_never_a_secret(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl")
    for i in range(50):
        _record(log, i)
    assert log.flush()
    lines = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [x["request_id"] for x in lines] == [f"r{i}" for i in range(50)]
    assert set(lines[0]) == set(FIELDS)
    assert lines[0]["key_id"] == "k1" and lines[0]["status"] == 200 and lines[0]["latency_ms"] == 1.0
    log.close()


def test_rotates_by_size(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl", max_bytes=2000, backups=2)
    for i in range(200):
        _record(log, i)
    assert log.flush()
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    assert all(p.stat().st_size <= 2000 for p in tmp_path.iterdir())
    last = json.loads((tmp_path / "audit.jsonl").read_text().splitlines()[-1])
    assert last["request_id"] == "r199"


def test_a_failed_write_is_counted_not_raised(tmp_path):
    folder = tmp_path / "gone"
    log = AuditLog(folder / "audit.jsonl")
    folder.rmdir()
    folder.write_text("now a file: the log's folder cannot be created or opened")
    for i in range(5):
        _record(log, i)  # must not raise
    assert log.flush()
    assert log.write_errors == 5 and log.written == 0
    log.close()


def test_a_writer_that_falls_behind_drops_and_counts(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl", max_pending=0)
    _record(log, 1)
    assert log.dropped == 1
    log.close()
