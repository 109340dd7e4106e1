"""Cold restores read with O_DIRECT (:mod:`azulite.train.direct`): the bytes land in our buffers, never in
the page cache, every byte is still hashed before anything is built, and warm files (or a file system that
refuses O_DIRECT) are read buffered as before."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from azulite.train import CheckpointConfig, Checkpointer, ModelState, Progress, init, list_checkpoints
from azulite.train import direct, hash_split
from azulite.train import prefetch as prefetch_module
from azulite.train.reader import VerifyingReader

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT") or prefetch_module._CACHESTAT is None,
                                reason="O_DIRECT and cachestat(2) (Linux >= 6.5)")


def _model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    return model, opt


def _save(root, seed, step):
    model, opt = _model(seed)
    ck = Checkpointer(CheckpointConfig(uri=str(root), keep_last=5), init({}),
                      {"model": ModelState(model, opt), "progress": Progress(step=step)})
    ck.save(step)
    ck.close()
    return model, opt


def _evict(d):
    """Drop the checkpoint's files from the page cache: the next read comes from the disk."""
    for p in d.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cached(p) -> bool:
    fd = os.open(p, os.O_RDONLY)
    try:
        return prefetch_module.in_cache(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _load(d):
    model, opt = _model(seed=99)
    progress = Progress()
    reader = VerifyingReader(d, json.loads((d / "manifest.json").read_text()), 2, str(d))
    dcp.load({"model": ModelState(model, opt), "progress": progress}, storage_reader=reader, no_dist=True)
    return model, opt, progress, reader


def _same(a, b, a_opt, b_opt):
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(a_opt.state[pa]["exp_avg_sq"], b_opt.state[pb]["exp_avg_sq"])


def test_a_cold_file_is_read_with_o_direct_and_a_warm_one_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(direct, "CHUNK", 64 << 10)  # several requests per file, chunks ending mid-record
    saved, saved_opt = _save(tmp_path, seed=1, step=3)
    d = tmp_path / "step-00000003"
    shards = sorted(d.glob("*.distcp"))
    _evict(d)
    model, opt, progress, reader = _load(d)
    _same(saved, model, saved_opt, opt)
    assert progress.step == 3
    assert {p.name: reader._direct[p] for p in shards} == {p.name: True for p in shards}
    assert reader.direct_bytes > 0 and reader.hashed_bytes == sum(p.stat().st_size for p in shards)
    # O_DIRECT bypassed the page cache: the shards are still not (wholly) in it
    assert not any(_cached(p) for p in shards)
    assert not direct._areas  # the buffers were unmapped at the restore's end

    # warm (the files in the cache): read buffered, as before
    for p in shards:
        p.read_bytes()
    model, opt, progress, reader = _load(d)
    _same(saved, model, saved_opt, opt)
    assert {p.name: reader._direct[p] for p in shards} == {p.name: False for p in shards}

    # O_DIRECT switched off (where a file system refuses it the reader gets None from open_stream too):
    # a cold file goes through the page-cache stream
    monkeypatch.setattr(direct, "ENABLED", False)
    _evict(d)
    model, opt, progress, reader = _load(d)
    _same(saved, model, saved_opt, opt)
    assert {p.name: reader._direct[p] for p in shards} == {p.name: False for p in shards}
    assert all(_cached(p) for p in shards)


def test_a_flipped_byte_read_with_o_direct_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    first, first_opt = _save(tmp_path, seed=1, step=1)
    _save(tmp_path, seed=2, step=2)
    d = tmp_path / "step-00000002"
    shard = max(d.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # tensor data, read in place with O_DIRECT
    shard.write_bytes(bytes(data))
    _evict(d)
    model, opt = _model(seed=99)
    progress = Progress()
    with caplog.at_level(logging.INFO, logger="azulite.train"):
        ck = Checkpointer(CheckpointConfig(uri=str(tmp_path)), init({}),
                          {"model": ModelState(model, opt), "progress": progress})
        assert ck.load_latest() == 1
        ck.close()
    assert f"checkpoint step 2 is corrupt: file {shard.name} does not match the manifest" in caplog.text
    _same(first, model, first_opt, opt)
    assert progress.step == 1
    assert [(c.step, c.committed) for c in list_checkpoints(str(tmp_path))] == [(1, True), (2, False)]


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 3 * 4096 + 17, 9 * 4096])
def test_the_stream_hands_out_every_byte_in_order_and_peeks_ahead(tmp_path, monkeypatch, size):
    monkeypatch.setattr(direct, "CHUNK", 8192)
    monkeypatch.setattr(direct, "DEPTH", 2)
    p = tmp_path / "f"
    data = os.urandom(size)
    p.write_bytes(data)
    stream = direct.open_stream(p, size)
    assert stream is not None
    try:
        got = bytearray()
        buf = bytearray(3000)  # reads that end inside chunks, and copies that end at a chunk's end
        while True:
            if stream.pos + 5000 <= size:  # bytes ahead of the reader, across a chunk boundary or not
                ahead = stream.peek(stream.pos + 100, 4900)
                assert ahead is None or ahead == data[stream.pos + 100 : stream.pos + 5000]
            n = stream.readinto(memoryview(buf))
            if not n:
                break
            got += buf[:n]
        assert bytes(got) == data
        assert stream.peek(0, 10) is None or size == 0  # behind the reader: not kept
    finally:
        stream.close()
    direct.release_areas()


def _ddp_rank(rank, port, root, out):
    ctx = init({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)})
    # no page-cache stream: the files are still cold when the readers decide how to read them
    prefetch_module.PREFETCH_AHEAD = 0
    model, opt = _model(seed=1)  # the same on both ranks: DCP writes each tensor once, both read all
    ck = Checkpointer(CheckpointConfig(uri=str(root)), ctx, {"model": ModelState(model, opt), "progress": Progress()})
    ck.save(1)
    torch.distributed.barrier()
    if rank == 0:
        _evict(root / "step-00000001")
    torch.distributed.barrier()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert ck.load_latest() == 1
    ck.close()
    (out / f"rank{rank}.json").write_text(json.dumps({**ck.last_restore, "sum": sum(float(p.sum()) for p in model.parameters())}))


def test_ranks_reading_the_same_files_share_the_page_cache_instead(tmp_path):
    """A DDP restore, cold: every rank reads every file, so the files go through the page cache (the disk
    reads each page once for both ranks); with O_DIRECT each rank read all of them from the disk."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_ddp_rank, args=(port, tmp_path / "ckpt", tmp_path), nprocs=2, start_method="spawn")
    shared = hash_split.shared_files([{"a": 1, "b": 2, "c": None}, {"a": 1, "b": 3, "c": None}])
    assert shared == [{"a"}, {"a"}]  # the same bytes (identity) only; a Blob download (None) never
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    model, _ = _model(seed=1)
    assert got[0]["sum"] == got[1]["sum"] == sum(float(p.sum()) for p in model.parameters())
    assert got[0]["direct_bytes"] == got[1]["direct_bytes"] > 0
    assert got[0]["o_direct_bytes"] == got[1]["o_direct_bytes"] == 0
    assert all(_cached(p) for p in (tmp_path / "ckpt" / "step-00000001").glob("*.distcp"))


def test_one_rank_alone_reads_a_cold_checkpoint_with_o_direct(tmp_path):
    saved, saved_opt = _save(tmp_path, seed=1, step=4)
    d = tmp_path / "step-00000004"
    _evict(d)
    model, opt = _model(seed=99)
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path)), init({}), {"model": ModelState(model, opt),
                                                                     "progress": Progress()})
    assert ck.load_latest() == 4
    ck.close()
    _same(saved, model, saved_opt, opt)
    assert ck.last_restore["o_direct_bytes"] == sum(p.stat().st_size for p in d.glob("*.distcp"))
    assert "readers_behind_stream_s" not in ck.last_restore  # the stream brought none of it
