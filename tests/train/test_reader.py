"""The verifying checkpoint reader, in one process: tensors read in place, everything hashed, nothing
built from a file before its hash matched, and a corrupt file falls back to the previous checkpoint."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.stateful import Stateful

from azulite.launch.local.procs import free_port
from azulite.train import CheckpointConfig, Checkpointer, ModelState, Progress, init, list_checkpoints
from azulite.train import prefetch as prefetch_module
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
    mp.start_processes(_two_ranks, args=(free_port(), tmp_path / "ckpt", tmp_path), nprocs=2, start_method="spawn")
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
        def _in_place(self, heads, req, target, *wait):
            at = self._prefetch._consumed
            got = super()._in_place(heads, req, target, *wait)
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


def test_a_restore_reads_only_what_the_prefetch_brought(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch_module, "in_cache", lambda fd, at, n: False)  # as if cold
    saved, _ = _save(tmp_path, seed=1, fill=3.0, step=7)
    d = tmp_path / "step-00000007"
    monkeypatch.setattr(prefetch_module, "PREFETCH_CHUNK", 4096)
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

    class Watched(prefetch_module.Prefetch):
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

    monkeypatch.setattr(prefetch_module, "Prefetch", Watched)
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


def test_the_prefetch_starts_when_the_checkpoint_is_chosen_and_narrows_to_the_plan(tmp_path):
    saved, _ = _save(tmp_path, seed=1, fill=3.0, step=7)
    d = tmp_path / "step-00000007"
    data = sorted(n for n in json.loads((d / "manifest.json").read_text())["files"] if n.endswith(".distcp"))
    seen = {}

    class Watched(VerifyingReader):
        def read_metadata(self, *args, **kwargs):
            # before DCP reads .metadata (and asks the state for its tensors, and plans): the disk
            # already streams .metadata, then every data file in the order a DDP rank reads them
            seen["at_metadata"] = [p.name for p in self._prefetch.paths]
            seen["issued"] = self._prefetch.issued.is_set()
            seen["first"] = self._prefetch
            return super().read_metadata(*args, **kwargs)

        def prepare_global_plan(self, plans):
            seen["at_plan"] = [p.name for p in self._prefetch.paths]
            seen["same"] = self._prefetch is seen["first"]
            return super().prepare_global_plan(plans)

    model, opt, odd, progress, state = _fresh()
    reader = Watched(d, json.loads((d / "manifest.json").read_text()), 2, str(d))
    reader.start_prefetch()
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), model.parameters()))
    assert seen["at_metadata"] == [".metadata", *data] and seen["issued"]
    assert seen["same"]  # the whole state reads every file: the stream goes on as it was
    assert not [t for t in threading.enumerate() if t.name == "azulite-prefetch" and t.is_alive()]

    # a load of part of the state reads fewer files: the stream narrows to them once the plan is known
    progress = Progress()
    reader = Watched(d, json.loads((d / "manifest.json").read_text()), 2, str(d))
    reader.start_prefetch()
    dcp.load({"progress": progress}, storage_reader=reader, no_dist=True)
    assert progress.step == 7
    assert seen["at_metadata"] == [".metadata", *data]
    assert not seen["same"] and seen["at_plan"] and set(seen["at_plan"]) < set(data)
    assert not [t for t in threading.enumerate() if t.name == "azulite-prefetch" and t.is_alive()]


def test_a_cold_restore_reports_when_the_disk_was_first_asked(tmp_path, monkeypatch):
    _save(tmp_path, seed=1, fill=3.0, step=7)
    model, opt, odd, progress, state = _fresh()
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path)), init({}), state)
    assert ck.load_latest() == 7  # warm (just written): nothing streamed, no figure
    if prefetch_module._CACHESTAT is not None:  # the kernel tells what is cached (cachestat, Linux >= 6.5)
        assert "first_read_s" not in ck.last_restore and "readers_behind_stream_s" not in ck.last_restore
    monkeypatch.setattr(prefetch_module, "in_cache", lambda fd, at, n: False)  # as if cold
    started = time.perf_counter()
    assert ck.load_latest() == 7
    took = time.perf_counter() - started
    ck.close()
    assert 0 < ck.last_restore["first_read_s"] < took
    # and how long the readers ran on after the stream's last byte: within the restore, after its first read
    assert -took < ck.last_restore["readers_behind_stream_s"] < took - ck.last_restore["first_read_s"]
