"""The verifying checkpoint reader, in one process: tensors read in place, everything hashed, nothing
built from a file before its hash matched, and a corrupt file falls back to the previous checkpoint."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.stateful import Stateful

from azulite.train import CheckpointConfig, Checkpointer, ModelState, Progress, init, list_checkpoints
from azulite.train import reader as reader_module
from azulite.train.reader import VerifyingReader
from azulite.train.restore import IntegrityError


class Odd(Stateful):
    """A tensor that cannot be read in place (transposed: not contiguous) and a small python value."""

    def __init__(self, fill: float) -> None:
        self.t = torch.full((16, 8), fill).t()
        self.tag = f"tag-{fill}"

    def state_dict(self):
        return {"t": self.t, "tag": self.tag}

    def load_state_dict(self, sd):
        self.t.copy_(sd["t"])
        self.tag = sd["tag"]


def _model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()  # Adam state exists: the checkpoint holds model + optimizer tensors
    return model, opt


def _reader(tmp_path, step):
    d = tmp_path / f"step-{step:08d}"
    return d, VerifyingReader(d, json.loads((d / "manifest.json").read_text()), 2, str(d))


def _save(tmp_path, seed, fill, step):
    ctx = init({})
    model, opt = _model(seed)
    progress = Progress(step=step)
    state = {"model": ModelState(model, opt), "progress": progress, "odd": Odd(fill)}
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path), keep_last=5), ctx, state)
    ck.save(step)
    ck.close()
    return model, opt


def _fresh(seed=99, fill=0.0):
    model, opt = _model(seed)
    odd = Odd(fill)
    progress = Progress()
    return model, opt, odd, progress, {"model": ModelState(model, opt), "progress": progress, "odd": odd}


def _tensor_bytes(model, opt):
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    return n + sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))


def test_tensors_are_read_in_place_and_everything_round_trips(tmp_path):
    saved, saved_opt = _save(tmp_path, seed=1, fill=3.0, step=7)
    model, opt, odd, progress, state = _fresh()
    _, reader = _reader(tmp_path, 7)
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), model.parameters()))
    for p_saved, p in zip(saved.parameters(), model.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved_opt.state[p_saved][k], opt.state[p][k])
    assert progress.step == 7 and odd.tag == "tag-3.0" and torch.equal(odd.t, torch.full((8, 16), 3.0))
    # model and optimizer tensors went straight into their targets; the transposed one did not
    assert reader.direct_bytes == _tensor_bytes(model, opt)


def test_nothing_is_built_from_a_file_whose_hash_does_not_match(tmp_path):
    _save(tmp_path, seed=1, fill=3.0, step=7)
    d, reader = _reader(tmp_path, 7)
    shard = max(d.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    model, opt, odd, progress, state = _fresh(fill=5.0)
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert isinstance(info.value, IntegrityError) or any(
        isinstance(v[0] if isinstance(v, tuple) else v, IntegrityError) for v in info.value.failures.values())
    assert f"file {shard.name} does not match the manifest" in str(info.value)
    # what is built from kept bytes (python values, tensors not read in place) was not touched
    assert progress.step == 0 and odd.tag == "tag-5.0" and torch.equal(odd.t, torch.full((8, 16), 5.0))


def test_a_flipped_byte_in_a_tensor_falls_back_to_the_previous_checkpoint_whole(tmp_path, caplog):
    first, first_opt = _save(tmp_path, seed=1, fill=1.0, step=1)
    _save(tmp_path, seed=2, fill=2.0, step=2)
    d = tmp_path / "step-00000002"
    shard = max(d.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # most of a shard is tensor data, read in place
    shard.write_bytes(bytes(data))

    model, opt, odd, progress, state = _fresh()
    with caplog.at_level(logging.INFO, logger="azulite.train"):
        ck = Checkpointer(CheckpointConfig(uri=str(tmp_path)), init({}), state)
        assert ck.load_latest() == 1
    assert f"checkpoint step 2 is corrupt: file {shard.name} does not match the manifest" in caplog.text
    # every tensor holds step 1's values: the corrupt bytes that reached a tensor were overwritten
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), model.parameters()))
    for p_first, p in zip(first.parameters(), model.parameters()):
        assert torch.equal(first_opt.state[p_first]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
    assert progress.step == 1 and odd.tag == "tag-1.0"
    assert [(c.step, c.committed) for c in list_checkpoints(str(tmp_path))] == [(1, True), (2, False)]
    assert (d / "manifest.corrupt.json").exists()


def test_a_truncated_file_is_named(tmp_path):
    _save(tmp_path, seed=1, fill=3.0, step=7)
    d, reader = _reader(tmp_path, 7)
    shard = max(d.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-10])
    *_, state = _fresh()
    with pytest.raises(BaseException, match=f"file {shard.name} is .* B, the manifest says"):
        dcp.load(state, storage_reader=reader, no_dist=True)


def _two_ranks(rank, port, root, out):
    ctx = init({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)})
    model, opt = _model(seed=1)  # the same on both ranks: DCP writes each tensor once, both read all
    ck = Checkpointer(CheckpointConfig(uri=str(root)), ctx, {"model": ModelState(model, opt), "progress": Progress()})
    ck.save(1)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert ck.load_latest() == 1
    ck.close()
    (out / f"rank{rank}.json").write_text(json.dumps({**ck.last_restore, "sum": sum(float(p.sum()) for p in model.parameters())}))


def test_ranks_reading_the_same_files_split_the_hashing(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_two_ranks, args=(port, tmp_path / "ckpt", tmp_path), nprocs=2, start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    manifest = json.loads((tmp_path / "ckpt" / "step-00000001" / "manifest.json").read_text())
    shards = sum(e["bytes"] for n, e in manifest["files"].items() if n.endswith(".distcp"))
    # both ranks loaded every tensor, each hashed a part, together every shard exactly once
    model, _ = _model(seed=1)
    assert got[0]["sum"] == got[1]["sum"] == sum(float(p.sum()) for p in model.parameters())
    assert got[0]["direct_bytes"] == got[1]["direct_bytes"] > 0
    assert 0 < got[0]["hashed_bytes"] < shards and 0 < got[1]["hashed_bytes"] < shards
    assert got[0]["hashed_bytes"] + got[1]["hashed_bytes"] == shards


def test_each_record_layout_is_read_just_before_its_bytes(tmp_path):
    saved, _ = _save(tmp_path, seed=1, fill=3.0, step=7)
    d = tmp_path / "step-00000007"
    layouts = []  # (file, record offset, bytes this rank had read when the layout was read, read in place)

    class Watched(VerifyingReader):
        def _in_place(self, heads, req, target):
            at = self._prefetch._consumed
            got = super()._in_place(heads, req, target)
            layouts.append((self.storage_data[req.storage_index].relative_path,
                            self.storage_data[req.storage_index].offset, at, got is not None))
            return got

    model, opt, odd, progress, state = _fresh()
    reader = Watched(d, json.loads((d / "manifest.json").read_text()), 1, str(d))  # one thread: files in turn
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), model.parameters()))
    # page cache cold, a layout read waits for its record to arrive: each record's layout is read after
    # the record before it was read (and hashed), not all of a file's up front
    assert sum(direct for *_, direct in layouts) >= 4
    for (f0, off0, at0, direct0), (f1, off1, at1, _) in zip(layouts, layouts[1:]):
        if f0 == f1:
            assert off0 < off1
            if direct0:
                assert at1 > at0, layouts


def test_the_prefetch_starts_with_the_local_plan_and_ends_with_the_load(tmp_path):
    saved, _ = _save(tmp_path, seed=1, fill=3.0, step=7)
    d = tmp_path / "step-00000007"
    seen = {}

    class Watched(VerifyingReader):
        def prepare_global_plan(self, plans):
            # DCP agrees on the plan here (collectives across ranks): the disk is already streaming
            seen["paths"] = None if self._prefetch is None else [p.name for p in self._prefetch.paths]
            return super().prepare_global_plan(plans)

    model, opt, odd, progress, state = _fresh()
    reader = Watched(d, json.loads((d / "manifest.json").read_text()), 1, str(d))
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), model.parameters()))
    assert seen["paths"] == sorted(n for n in json.loads((d / "manifest.json").read_text())["files"]
                                   if n.endswith(".distcp"))
    assert reader._prefetch is None
    assert not [t for t in threading.enumerate() if t.name == "azulite-prefetch"]

    # a load that fails between its plan and its reads stops the prefetch too (Checkpointer._load)
    class Failing(VerifyingReader):
        def prepare_global_plan(self, plans):
            raise RuntimeError("planted")

    reader = Failing(d, json.loads((d / "manifest.json").read_text()), 1, str(d))
    with pytest.raises(BaseException) as failed:  # noqa: PT011 - DCP wraps it: CheckpointException(BaseException)
        try:
            dcp.load(state, storage_reader=reader, no_dist=True)
        finally:
            reader.stop_prefetch()
    assert "planted" in repr(getattr(failed.value, "failures", failed.value))
    assert not [t for t in threading.enumerate() if t.name == "azulite-prefetch" and t.is_alive()]


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
    monkeypatch.setattr(reader_module, "_in_cache", lambda fd, at, n: False)  # as if cold
    chunk = 4096
    paths = _files(tmp_path, 5 * chunk, 3 * chunk + 100)
    monkeypatch.setattr(reader_module, "PREFETCH_CHUNK", chunk)
    monkeypatch.setattr(reader_module, "PREFETCH_AHEAD", 2 * chunk)
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
    box["p"] = prefetch = reader_module._Prefetch(paths)
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
    monkeypatch.setattr(reader_module, "_in_cache", lambda fd, at, n: False)  # as if cold
    chunk = 4096
    paths = _files(tmp_path, 3 * chunk, 2 * chunk)
    monkeypatch.setattr(reader_module, "PREFETCH_CHUNK", chunk)
    events, lock, go = [], threading.Lock(), threading.Event()
    real = os.sendfile

    def held(out, fd, offset, count):
        assert go.wait(timeout=30)  # the prefetch is held until the readers below are waiting
        sent = real(out, fd, offset, count)
        with lock:
            events.append(("brought", os.readlink(f"/proc/self/fd/{fd}"), offset + sent))
        return sent

    monkeypatch.setattr(os, "sendfile", held)
    prefetch = reader_module._Prefetch(paths, streams=2)
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
    monkeypatch.setattr(reader_module, "_in_cache", lambda fd, at, n: False)  # as if cold
    chunk = 4096
    paths = _files(tmp_path, 4 * chunk, 4 * chunk)
    monkeypatch.setattr(reader_module, "PREFETCH_CHUNK", chunk)
    monkeypatch.setattr(reader_module, "PREFETCH_AHEAD", chunk)
    prefetch = reader_module._Prefetch([*paths, tmp_path / "missing"])
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
    monkeypatch.setattr(reader_module, "_in_cache", lambda fd, at, n: False)  # as if cold
    chunk = 4096
    paths = _files(tmp_path, 2 * chunk + 7, chunk)
    monkeypatch.setattr(reader_module, "PREFETCH_CHUNK", chunk)
    advised, real = [], os.posix_fadvise

    def no_sendfile(out, fd, offset, count):
        raise OSError(errno.ENOTSOCK, "Socket operation on non-socket")  # macOS: sockets only

    def watched(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "sendfile", no_sendfile)
    monkeypatch.setattr(os, "posix_fadvise", watched)
    prefetch = reader_module._Prefetch(paths)
    try:
        prefetch.ready(paths[1], chunk)
    finally:
        prefetch.stop()
    assert advised == [(str(paths[0]), 0, chunk), (str(paths[0]), chunk, chunk), (str(paths[0]), 2 * chunk, 7),
                       (str(paths[1]), 0, chunk)]


def test_a_restore_reads_only_what_the_prefetch_brought(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_module, "_in_cache", lambda fd, at, n: False)  # as if cold
    saved, _ = _save(tmp_path, seed=1, fill=3.0, step=7)
    d = tmp_path / "step-00000007"
    monkeypatch.setattr(reader_module, "PREFETCH_CHUNK", 4096)
    monkeypatch.setattr(reader_module, "CHUNK", 4096)
    box: dict = {}
    asked: list[tuple[str, int, int]] = []  # (file, end asked for, bytes of it in the cache then)
    reads: list[tuple[str, int, int]] = []  # (file, end of a data read, bytes of it in the cache then)

    # the prefetch brings a piece only once a reader asked for bytes beyond it: a reader that did not ask
    # before reading reads bytes that are not there yet, every time
    asking, wanted, gave_up = threading.Condition(), {}, threading.Event()
    real = os.sendfile

    def on_demand(out, fd, offset, count):
        path = os.readlink(f"/proc/self/fd/{fd}")
        with asking:
            if not gave_up.is_set() and not asking.wait_for(lambda: wanted.get(path, 0) > offset, timeout=30):
                gave_up.set()
        return real(out, fd, offset, count)

    class Watched(reader_module._Prefetch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            box["p"] = self

        def ready(self, path, end):
            with asking:
                wanted[str(path)] = max(wanted.get(str(path), 0), end)
                asking.notify_all()
            super().ready(path, end)
            with self._cond:
                asked.append((path.name, end, self._cached.get(path, 0)))

    class Checked:
        """A data file as the reader reads it: each read notes how much of the file was in the cache."""

        def __init__(self, path, f):
            self.path, self.f = path, f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def fileno(self):
            return self.f.fileno()

        def readinto(self, view):
            end = min(self.f.tell() + len(view), os.fstat(self.f.fileno()).st_size)
            with box["p"]._cond:
                reads.append((self.path.name, end, box["p"]._cached.get(self.path, 0)))
            return self.f.readinto(view)

    def checked_open(path, mode="r", buffering=-1):
        f = open(path, mode, buffering=buffering)  # noqa: SIM115 - closed by the reader
        return Checked(path, f) if buffering == 0 else f

    monkeypatch.setattr(reader_module, "_Prefetch", Watched)
    monkeypatch.setattr(reader_module, "open", checked_open, raising=False)
    monkeypatch.setattr(os, "sendfile", on_demand)
    model, opt, odd, progress, state = _fresh()
    reader = VerifyingReader(d, json.loads((d / "manifest.json").read_text()), 2, str(d))
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), model.parameters()))
    assert odd.tag == "tag-3.0" and torch.equal(odd.t, torch.full((16, 8), 3.0).t())
    shards = {p.name: p.stat().st_size for p in d.glob("*.distcp")}
    # every byte of every shard was read after the prefetch brought it (layouts and data alike)
    assert {name: max(end for n, end, _ in reads if n == name) for name in shards} == shards
    assert len(reads) >= sum(shards.values()) // 4096
    assert all(cached >= end for _, end, cached in reads), reads
    assert all(cached >= end for _, end, cached in asked), asked
    assert not gave_up.is_set()


def test_the_prefetch_passes_over_a_file_already_in_the_cache(tmp_path, monkeypatch):
    chunk = 4096
    warm, cold = _files(tmp_path, 4 * chunk, 4 * chunk)
    fd = os.open(warm, os.O_RDONLY)
    try:
        just_written = reader_module._in_cache(fd, 0, 4 * chunk)
        if reader_module._CACHESTAT is None:
            pytest.skip("no cachestat(2) here (Linux >= 6.5)")
        assert just_written
        assert not reader_module._in_cache(fd, 4 * chunk, chunk)  # past its end: nothing is
        assert not reader_module._in_cache(fd, 3 * chunk, 2 * chunk)
    finally:
        os.close(fd)
    _evict(cold)
    fd = os.open(cold, os.O_RDONLY)
    try:
        if reader_module._in_cache(fd, 0, 4 * chunk):
            pytest.skip("the file could not be evicted from the page cache here (tmpfs?)")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 1, 0)  # its first page only (no readahead past it)
    finally:
        os.close(fd)
    monkeypatch.setattr(reader_module, "PREFETCH_CHUNK", chunk)
    sent, real = [], os.sendfile

    def watched(out, fd, offset, count):
        sent.append((os.readlink(f"/proc/self/fd/{fd}"), offset))
        return real(out, fd, offset, count)

    monkeypatch.setattr(os, "sendfile", watched)
    prefetch = reader_module._Prefetch([warm, cold])
    try:
        prefetch.ready(warm, 4 * chunk)
        prefetch.ready(cold, 4 * chunk)
    finally:
        prefetch.stop()
    # the file just written is not read again; the one only partly in the cache is read whole, in order
    assert sent and all(path == str(cold) for path, _ in sent), sent
    assert [offset for _, offset in sent] == sorted(offset for _, offset in sent) and sent[0][1] == 0, sent
