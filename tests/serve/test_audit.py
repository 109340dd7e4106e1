"""The audit log: one JSON line per request off the request path, rotation by size, a failing disk
counted and never raised."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from azulite.serve.audit import FIELDS, AuditLog


def _record(log: AuditLog, i: int) -> None:
    log.record(f"r{i}", "k1", "127.0.0.1:5", "m", "1", "http", 200, 0.001, 10, 20)


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


def test_a_line_takes_the_time_its_caller_read(tmp_path):
    """``at`` (the HTTP route's own end-of-request perf_counter read) is the line's time, not a new read."""
    import time

    log = AuditLog(tmp_path / "audit.jsonl")
    log.record("then", "k1", "c", "m", "1", "http", 200, 0.001, 10, 20, time.perf_counter() - 3600.0)
    log.record(None, "k1", "c", "m", "1", "http", 200, 0.001, 10, 20, time.perf_counter() - 7200.0)
    log.record("now", "k1", "c", "m", "1", "http", 200, 0.001, 10, 20)
    assert log.flush()
    then, earlier, now = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert abs(now["time"] - time.time()) < 600  # a generous net: the lines are written within seconds
    assert abs(now["time"] - then["time"] - 3600.0) < 600 and abs(now["time"] - earlier["time"] - 7200.0) < 600
    log.close()


def test_rotates_by_size(tmp_path):
    old = os.umask(0o022)  # the writer process inherits it: its files were left readable by every local user
    try:
        log = AuditLog(tmp_path / "audit.jsonl", max_bytes=2000, backups=2)
    finally:
        os.umask(old)
    for i in range(200):
        _record(log, i)
    assert log.flush()
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    assert {stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {0o600}  # clients and keys: the owner's
    assert all(p.stat().st_size <= 2000 for p in tmp_path.iterdir())
    last = json.loads((tmp_path / "audit.jsonl").read_text().splitlines()[-1])
    assert last["request_id"] == "r199"
    # every file whole lines, each its own JSON document, the newest ones in order across the files
    texts = [(tmp_path / name).read_text() for name in ("audit.jsonl.2", "audit.jsonl.1", "audit.jsonl")]
    assert all(t.endswith("\n") for t in texts)
    ids = [int(json.loads(line)["request_id"][1:]) for t in texts for line in t.splitlines()]
    assert ids == list(range(200 - len(ids), 200))


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


def test_hostile_strings_stay_one_json_line_and_ids_are_assigned(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl")
    log.record(None, None, "c", 'model"\n\u2028}{', "", "grpc", "INVALID_ARGUMENT", 0.5, 0, 0)
    log.record(None, None, "c", "m", "", "grpc", "OK", 0.5, 0, 0)
    assert log.flush()
    first, second = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert first["model"] == 'model"\n\u2028}{' and first["key_id"] is None and first["status"] == "INVALID_ARGUMENT"
    assert first["request_id"] != second["request_id"] and first["latency_ms"] == 500.0
    log.record("r", None, "c", "m", "", "grpc", "OK", 0.5, None, 0)  # a size no slot holds: lost, counted
    log.record("r", None, "c", "m", "", "grpc", "OK", 0.5, 1 << 70, 0)
    log.record(None, None, "c", ["m"], "", "grpc", "OK", 0.5, 3, 4)
    log.record(None, None, "c", "m", "", "grpc", "OK", 0.5, 3, 4)
    assert log.flush()
    assert log.write_errors == 3 and log.written == 3
    log.close()


def test_a_writer_that_falls_behind_drops_and_counts(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl", max_pending=0)
    _record(log, 1)
    assert log.dropped == 1
    log.close()


def test_lines_queued_when_the_interpreter_exits_are_written(tmp_path):
    """A process that ends without closing its log (an unhandled error, sys.exit from a signal handler)
    still writes every line it recorded: the writer is a daemon thread, so nothing but the exit hook
    would."""
    script = textwrap.dedent(f"""
        from azulite.serve.audit import AuditLog
        log = AuditLog({str(tmp_path / "audit.jsonl")!r}, batch_s=3600.0)  # the timer never fires
        for i in range(1000):
            log.record(f"r{{i}}", "k1", "c", "m", "1", "http", 200, 0.001, 10, 20)
        raise SystemExit(3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ}, timeout=120)
    assert proc.returncode == 3
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert [json.loads(x)["request_id"] for x in lines] == [f"r{i}" for i in range(1000)]


def _writer_pid(log: AuditLog) -> int:
    assert log._proc is not None
    return log._proc.pid


def test_a_writer_process_that_dies_is_replaced(tmp_path):
    """The writer process killed between batches: the next batch starts a new one and nothing is lost."""
    log = AuditLog(tmp_path / "audit.jsonl")
    _record(log, 0)
    assert log.flush()
    first = log._proc
    first.kill()
    first.wait(60)
    for i in range(1, 6):
        _record(log, i)
    assert log.flush()
    assert _writer_pid(log) != first.pid
    lines = [json.loads(x)["request_id"] for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert lines == [f"r{i}" for i in range(6)] and log.written == 6 and log.write_errors == 0
    log.close()


def test_the_writer_ignores_sigterm_and_sigint(tmp_path):
    """A signal to the whole process group (Ctrl-C, a service manager) must not end the writer before the
    server hands over its last lines: it ends when the server closes the pipe."""
    import signal

    log = AuditLog(tmp_path / "audit.jsonl")
    _record(log, 0)
    assert log.flush()  # the writer is up, its handlers set
    pid = _writer_pid(log)
    os.kill(pid, signal.SIGTERM)
    os.kill(pid, signal.SIGINT)
    _record(log, 1)
    assert log.flush()  # a round trip after both signals: a writer they ended could not have answered
    assert _writer_pid(log) == pid and log.written == 2 and log.write_errors == 0
    log.close()
    assert log._proc is None


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for init to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _kill_server_and_wait_for_its_writer(script: str) -> None:
    """Run ``script`` (a server that prints its audit writer's pid, then blocks), SIGKILL it, and wait until
    the orphaned writer has exited (it exits once it has read the closed stdin and written the ring)."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ})
    try:
        writer = int(proc.stdout.readline())
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    deadline = time.monotonic() + 60  # a safety net only
    while not _gone(writer) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the condition (no event crosses from an orphan); not a timed assertion
    assert _gone(writer), "the audit writer outlived its server"


def test_the_writer_exits_when_the_server_is_killed(tmp_path):
    """SIGKILL of the server: its writer sees the pipe close, writes what it had received, and exits —
    no process is left behind."""
    script = textwrap.dedent(f"""
        import sys
        from azulite.serve.audit import AuditLog
        log = AuditLog({str(tmp_path / "audit.jsonl")!r})
        log.record("r0", "k1", "c", "m", "1", "http", 200, 0.001, 10, 20)
        log.flush()
        print(log._proc.pid, flush=True)
        sys.stdin.read()  # until killed
    """)
    _kill_server_and_wait_for_its_writer(script)
    assert json.loads((tmp_path / "audit.jsonl").read_text().splitlines()[0])["request_id"] == "r0"


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_server_killed_loses_nothing_it_had_recorded(tmp_path):
    """SIGKILL of the server before the writer's timer ever fired: the writer holds the ring's memory,
    sees its stdin close, and still writes every record packed into it."""
    script = textwrap.dedent(f"""
        import sys
        from azulite.serve.audit import AuditLog
        log = AuditLog({str(tmp_path / "audit.jsonl")!r}, batch_s=3600.0)  # the timer never fires
        for i in range(3000):
            log.record(f"r{{i}}", "k1", f"c{{i % 7}}", "m", "1", "http", 200, 0.001, 10, 20)
        print(log._proc.pid, flush=True)
        sys.stdin.read()  # until killed
    """)
    _kill_server_and_wait_for_its_writer(script)
    lines = _lines(tmp_path / "audit.jsonl")
    assert [x["request_id"] for x in lines] == [f"r{i}" for i in range(3000)]
    assert [x["client"] for x in lines[:8]] == [f"c{i % 7}" for i in range(8)]


def test_long_request_ids_are_cut_and_marked_and_bytes_ids_taken(tmp_path):
    from azulite.serve.audit_writer import CUT_MARK, RID_MAX

    log = AuditLog(tmp_path / "audit.jsonl")
    exact, long = "x" * RID_MAX, "é" * RID_MAX  # two bytes a character: cut inside one is replaced, not raised
    log.record(exact, None, "c", "m", "", "http", 200, 0.0, 0, 0)
    log.record(long, None, "c", "m", "", "http", 200, 0.0, 0, 0)
    log.record(b"raw-header-id", None, "c", "m", "", "http", 200, 0.0, 0, 0)
    assert log.flush()
    first, second, third = _lines(tmp_path / "audit.jsonl")
    assert first["request_id"] == exact
    assert second["request_id"].endswith(CUT_MARK) and second["request_id"].startswith("é" * (RID_MAX // 2 - 1))
    assert third["request_id"] == "raw-header-id"
    log.close()


def test_past_4096_distinct_callers_ids_are_forgotten_and_every_line_stays_right(tmp_path):
    """Each distinct (key, client, model, version, protocol, status) is defined once in the ring; past
    4096 the server forgets them and tells the writer, and defines them again."""
    log = AuditLog(tmp_path / "audit.jsonl", max_pending=1 << 16)
    n = 5000
    for round_ in range(2):
        for i in range(n):
            log.record(f"{round_}-{i}", f"k{i}", f"10.0.0.{i % 250}:{i}", f"model-{i % 3}", "1", "grpc",
                       "OK" if i % 2 else 200, 0.002, i, 2 * i)
    assert log.flush()
    lines = _lines(tmp_path / "audit.jsonl")
    assert len(lines) == 2 * n and log.written == 2 * n and log.dropped == 0 and log.write_errors == 0
    for j, x in enumerate(lines):
        i = j % n
        assert (x["request_id"], x["key_id"], x["client"], x["model"], x["status"], x["bytes_out"]) == (
            f"{j // n}-{i}", f"k{i}", f"10.0.0.{i % 250}:{i}", f"model-{i % 3}", "OK" if i % 2 else 200, 2 * i)
    log.close()


def test_a_full_ring_drops_and_counts_then_takes_records_again(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl", max_pending=8, batch_s=3600.0)  # only a flush reads the ring
    for i in range(6):
        _record(log, i)  # 7 slots: the define of (k1, address, ...), then the records
    log.record("other", "k2", "c", "m", "1", "http", 200, 0.0, 0, 0)  # a define and its record: 1 slot left
    assert log.dropped == 1
    _record(log, 6)  # the last slot
    _record(log, 7)
    assert log.dropped == 2
    assert log.flush()
    log.record("r99", "k2", "c", "m", "1", "http", 200, 0.0, 0, 0)
    assert log.flush()
    lines = _lines(tmp_path / "audit.jsonl")
    assert [x["request_id"] for x in lines] == [f"r{i}" for i in range(7)] + ["r99"]
    assert [x["key_id"] for x in lines] == ["k1"] * 7 + ["k2"]
    assert log.written == 8 and log.dropped == 2
    log.close()
    _record(log, 100)  # after close: dropped, counted, never raised
    assert log.dropped == 3 and log.written == 8


def test_records_across_the_rings_end_are_read_in_one_pass(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl", max_pending=16, batch_s=3600.0)  # only a flush reads the ring
    for i in range(10):
        _record(log, i)  # the define and r0..r9: slots 0-10
    assert log.flush()
    for i in range(10, 25):
        _record(log, i)  # slots 11-15, then 0-9: one read crosses the end
    assert log.flush()
    assert [x["request_id"] for x in _lines(tmp_path / "audit.jsonl")] == [f"r{i}" for i in range(25)]
    assert log.written == 25 and log.dropped == 0
    log.close()


@pytest.mark.parametrize("now,base", [(1795000500.25, 1795000000.0), (500.25, 0.0)])  # today; near the epoch
def test_a_lines_time_has_the_digits_of_the_full_format(tmp_path, now, base):
    """The writer formats a time within 999 s after now's multiple of 1000 s as that multiple's leading
    digits and a short float (Writer.drain: a third of a line's cost less): the digits must be those of
    ``%.6f`` of the whole value — inside the window, at and past its edges (a rounding that would carry
    into a fourth digit), before it, and far from it (the full format)."""
    import mmap
    import random
    import re

    from azulite.serve.audit_writer import HEADER, NO_RID, RID, SLOT, Writer

    offset = base - 1000.0  # a record's time t is perf_counter's: wall = t + offset
    walls = [base, base + 1e-7, base + 5e-7, base + 0.0000004, base + 998.9999994, base + 998.9999996,
             base + 999.0, base + 999.4999996, base + 999.9999996, base + 1000.0, base - 1e-7, base - 4e-7,
             base - 5000.123456789, base + 86400.5, 1e9, 12.5]
    rng = random.Random(11)
    walls += [base + rng.uniform(-50.0, 1050.0) for _ in range(2000)]
    size = 4096
    fd = os.memfd_create("audit-test")
    try:
        os.ftruncate(fd, HEADER + size * SLOT.size)
        with mmap.mmap(fd, HEADER + size * SLOT.size) as ring:
            for i, wall in enumerate(walls):
                SLOT.pack_into(ring, HEADER + i * SLOT.size, wall - offset, 0.001, 1, 2, 1,
                               RID if i % 2 else NO_RID, b"r%d" % i if i % 2 else b"", i + 1)
            writer = Writer(str(tmp_path / "audit.jsonl"), 1 << 30, 1, None, "boot")
            writer.attach(fd)
            writer.define(1, ("k", "c", "m", "1", "http", 200))
            writer.drain(now=now, offset=offset)
            writer.close()
    finally:
        os.close(fd)
    got = re.findall(rb'^\{"time":([^,]*),', (tmp_path / "audit.jsonl").read_bytes(), re.M)
    assert got == [b"%.6f" % (wall - offset + offset) for wall in walls]
