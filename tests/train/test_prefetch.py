"""The restore's prefetch on its own: files streamed in order and a bounded distance ahead, readers that
wait for what it brought (and never for a stream that cannot go on), advice where sendfile cannot write to
a file, and files already in the page cache passed over."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from azulite.train import prefetch as prefetch_module


def _evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _files(tmp_path, *sizes):
    paths = []
    for i, n in enumerate(sizes):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(os.urandom(n))
    return paths


def test_the_prefetch_reads_the_files_in_order_and_stays_a_bounded_distance_ahead(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch_module, "in_cache", lambda fd, at, n: False)  # as if cold
    chunk = 4096
    paths = _files(tmp_path, 5 * chunk, 3 * chunk + 100)
    monkeypatch.setattr(prefetch_module, "PREFETCH_CHUNK", chunk)
    monkeypatch.setattr(prefetch_module, "PREFETCH_AHEAD", 2 * chunk)
    calls, changed, box, ready = [], threading.Condition(), {}, threading.Event()
    real = os.sendfile

    def watched(out, fd, offset, count):
        assert ready.wait(timeout=30)
        consumed = box["p"]._consumed  # read at once: what the prefetch went on
        sent = real(out, fd, offset, count)  # a plain sequential read: the kernel's readahead, no copy out
        with changed:
            calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, sent, consumed))
            changed.notify_all()
        return sent

    def wait_for(n):
        with changed:
            assert changed.wait_for(lambda: len(calls) >= n, timeout=30), calls

    monkeypatch.setattr(os, "sendfile", watched)
    box["p"] = prefetch = prefetch_module.Prefetch(paths)
    ready.set()  # the thread's first call waits until box["p"] is set
    expected = [(str(paths[0]), i * chunk, chunk) for i in range(5)]
    expected += [(str(paths[1]), i * chunk, chunk) for i in range(3)] + [(str(paths[1]), 3 * chunk, 100)]
    try:
        # nothing consumed: it reads PREFETCH_AHEAD bytes, then waits for the readers
        assert prefetch.waited.wait(timeout=30)
        with changed:
            assert [c[:3] for c in calls] == expected[:2]
        prefetch.consumed(chunk)  # one chunk read: one more may be brought in
        wait_for(3)
        prefetch.consumed(10 * chunk)  # everything read: the rest follows, in order
        wait_for(len(expected))
    finally:
        prefetch.stop()
    assert [c[:3] for c in calls] == expected
    # never more than PREFETCH_AHEAD beyond what was consumed when each chunk was read
    brought = 0
    for _, _, length, consumed in calls:
        assert brought - consumed < 2 * chunk, calls
        brought += length


def test_a_reader_waits_until_the_prefetch_brought_what_it_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch_module, "in_cache", lambda fd, at, n: False)  # as if cold
    chunk = 4096
    paths = _files(tmp_path, 3 * chunk, 2 * chunk)
    monkeypatch.setattr(prefetch_module, "PREFETCH_CHUNK", chunk)
    events, lock, go = [], threading.Lock(), threading.Event()
    real = os.sendfile

    def held(out, fd, offset, count):
        assert go.wait(timeout=30)  # the prefetch is held until the readers below are waiting
        sent = real(out, fd, offset, count)
        with lock:
            events.append(("brought", os.readlink(f"/proc/self/fd/{fd}"), offset + sent))
        return sent

    monkeypatch.setattr(os, "sendfile", held)
    prefetch = prefetch_module.Prefetch(paths, streams=2)
    wants = [(paths[0], 1), (paths[0], 3 * chunk), (paths[1], chunk + 1), (paths[1], 2 * chunk)]

    def reader(path, end):
        prefetch.ready(path, end)
        with lock:
            events.append(("ready", str(path), end))

    threads = [threading.Thread(target=reader, args=w) for w in wants]
    try:
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive()
    finally:
        prefetch.stop()
    # each reader went on only after the bytes it asked for were in the cache
    for i, (kind, path, end) in enumerate(events):
        if kind == "ready":
            assert any(k == "brought" and p == path and e >= end for k, p, e in events[:i]), events
    assert sum(kind == "ready" for kind, *_ in events) == len(wants)


def test_readers_never_wait_on_a_prefetch_that_cannot_go_on(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch_module, "in_cache", lambda fd, at, n: False)  # as if cold
    chunk = 4096
    paths = _files(tmp_path, 4 * chunk, 4 * chunk)
    monkeypatch.setattr(prefetch_module, "PREFETCH_CHUNK", chunk)
    monkeypatch.setattr(prefetch_module, "PREFETCH_AHEAD", chunk)
    prefetch = prefetch_module.Prefetch([*paths, tmp_path / "missing"])
    try:
        # the stream waits for the readers (one chunk ahead, none consumed): a reader of bytes it has not
        # brought reads them itself instead of waiting for ever
        assert prefetch.waited.wait(timeout=30)
        prefetch.ready(paths[1], 4 * chunk)
        prefetch.ready(tmp_path / "elsewhere", 1)  # not one of its files
        prefetch.consumed(10 * chunk)
        prefetch.ready(tmp_path / "missing", 1)  # its stream ended (no such file): the read names it
    finally:
        prefetch.stop()


def test_without_sendfile_to_a_file_the_prefetch_falls_back_to_advice(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch_module, "in_cache", lambda fd, at, n: False)  # as if cold
    chunk = 4096
    paths = _files(tmp_path, 2 * chunk + 7, chunk)
    monkeypatch.setattr(prefetch_module, "PREFETCH_CHUNK", chunk)
    advised, real = [], os.posix_fadvise

    def no_sendfile(out, fd, offset, count):
        raise OSError(errno.ENOTSOCK, "Socket operation on non-socket")  # macOS: sockets only

    def watched(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "sendfile", no_sendfile)
    monkeypatch.setattr(os, "posix_fadvise", watched)
    prefetch = prefetch_module.Prefetch(paths)
    try:
        prefetch.ready(paths[1], chunk)
    finally:
        prefetch.stop()
    assert advised == [(str(paths[0]), 0, chunk), (str(paths[0]), chunk, chunk), (str(paths[0]), 2 * chunk, 7),
                       (str(paths[1]), 0, chunk)]


def test_the_prefetch_passes_over_a_file_already_in_the_cache(tmp_path, monkeypatch):
    chunk = 4096
    warm, cold = _files(tmp_path, 4 * chunk, 4 * chunk)
    fd = os.open(warm, os.O_RDONLY)
    try:
        just_written = prefetch_module.in_cache(fd, 0, 4 * chunk)
        if prefetch_module._CACHESTAT is None:
            pytest.skip("no cachestat(2) here (Linux >= 6.5)")
        assert just_written
        assert not prefetch_module.in_cache(fd, 4 * chunk, chunk)  # past its end: nothing is
        assert not prefetch_module.in_cache(fd, 3 * chunk, 2 * chunk)
    finally:
        os.close(fd)
    _evict(cold)
    fd = os.open(cold, os.O_RDONLY)
    try:
        if prefetch_module.in_cache(fd, 0, 4 * chunk):
            pytest.skip("the file could not be evicted from the page cache here (tmpfs?)")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 1, 0)  # its first page only (no readahead past it)
    finally:
        os.close(fd)
    monkeypatch.setattr(prefetch_module, "PREFETCH_CHUNK", chunk)
    sent, real = [], os.sendfile

    def watched(out, fd, offset, count):
        sent.append((os.readlink(f"/proc/self/fd/{fd}"), offset))
        return real(out, fd, offset, count)

    monkeypatch.setattr(os, "sendfile", watched)
    prefetch = prefetch_module.Prefetch([warm, cold])
    try:
        prefetch.ready(warm, 4 * chunk)
        prefetch.ready(cold, 4 * chunk)
    finally:
        prefetch.stop()
    # the file just written is not read again; the one only partly in the cache is read whole, in order
    assert sent and all(path == str(cold) for path, _ in sent), sent
    assert [offset for _, offset in sent] == sorted(offset for _, offset in sent) and sent[0][1] == 0, sent
