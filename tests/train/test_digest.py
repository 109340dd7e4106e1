"""Manifest digests: new checkpoints record BLAKE3 per segment of each file; manifests written before
(one sha256 or BLAKE3 digest per file) are still verified with it, and a corrupt file is still found."""

from __future__ import annotations

import hashlib
import json
import logging

import blake3
import pytest
import torch

from azulite.train import CheckpointConfig, Checkpointer, ModelState, Progress, digest, init


def _checkpointer(path, seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(32, 16)
    progress = Progress()
    return model, progress, Checkpointer(CheckpointConfig(uri=str(path)), init({}), {"model": ModelState(model),
                                                                                       "progress": progress})


def segmented(data, size=None):
    """The entry a new manifest records for ``data``, computed here with blake3 itself."""
    size = size or digest.SEGMENT
    return {"blake3_segments": [blake3.blake3(data[i : i + size]).hexdigest() for i in range(0, max(len(data), 1), size)],
            "segment_bytes": size, "bytes": len(data)}


def _to_whole(step_dir, algorithm):
    """Rewrite a manifest the way manifests were written before segments: one digest of every file
    (sha256 before BLAKE3)."""
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest["format"] == "azulite.checkpoint/2"
    manifest["format"] = "azulite.checkpoint/1"
    for name, entry in manifest["files"].items():
        data = (step_dir / name).read_bytes()
        assert entry == segmented(data)
        manifest["files"][name] = {algorithm: hashlib.new(algorithm, data).hexdigest() if algorithm == "sha256"
                                   else blake3.blake3(data).hexdigest(), "bytes": len(data)}
    path.unlink()
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_a_whole_file_manifest_is_verified_with_its_algorithm(tmp_path, caplog, algorithm):
    for step in (1, 2):
        saved, progress, ck = _checkpointer(tmp_path, seed=step)
        progress.step = step
        ck.save(step)
        ck.close()
        _to_whole(tmp_path / f"step-{step:08d}", algorithm)
        if step == 1:
            first = saved.weight.detach().clone()
    shard = next((tmp_path / "step-00000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))

    model, progress, ck = _checkpointer(tmp_path, seed=99)
    with caplog.at_level(logging.INFO, logger="azulite.train"):
        assert ck.load_latest() == 1
    assert f"file {shard.name} does not match the manifest ({algorithm} " in caplog.text
    assert torch.equal(model.weight, first) and progress.step == 1


def test_an_entry_without_a_known_digest_is_an_integrity_error():
    assert digest.algorithm_of({"sha256": "ab", "bytes": 1}) == "sha256"
    with pytest.raises(digest.IntegrityError, match="has no digest"):
        digest.algorithm_of({"md5": "ab", "bytes": 1})


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 3 * 4096, 3 * 4096 + 5])
def test_segments_cover_every_byte_once_and_name_the_bad_range(monkeypatch, n):
    monkeypatch.setattr(digest, "SEGMENT", 4096)
    data = bytes(range(256)) * (n // 256) + bytes(n % 256)
    s = digest.Segmenter()
    for i in range(0, n, 1000):  # writes that straddle segment boundaries
        s.update(data[i : i + 1000])
    assert s.entry() == segmented(data, 4096)
    digest.check_bytes(data, s.entry(), "f", "here")
    if not n:
        return
    for at in (0, n // 2, n - 1):
        bad = bytearray(data)
        bad[at] ^= 1
        lo = at // 4096 * 4096
        with pytest.raises(digest.IntegrityError, match=rf"file f does not match the manifest \(blake3 of bytes "
                                                         rf"\[{lo}, {min(lo + 4096, n)}\) .*\[here\]"):
            digest.check_bytes(bad, s.entry(), "f", "here")
    with pytest.raises(digest.IntegrityError, match=f"file f is {n - 1} B, the manifest says {n} B"):
        digest.check_bytes(data[:-1], s.entry(), "f", "here")
    # a reader that hashes only some segments checks only those: the others are another reader's
    bad = bytearray(data)
    bad[0] ^= 1  # segment 0
    odd = digest.Checker(s.entry(), "f", "here", mine=lambda k: k % 2 == 1)
    odd.update(bad)
    odd.finish()
    assert odd.hashed == sum(len(data[i : i + 4096]) for i in range(4096, n, 8192))
    even = digest.Checker(s.entry(), "f", "here", mine=lambda k: k % 2 == 0)
    with pytest.raises(digest.IntegrityError, match=r"bytes \[0, "):
        even.update(bad)
        even.finish()


def test_an_entry_whose_segments_do_not_cover_its_bytes_is_refused():
    entry = segmented(bytes(10000), 4096)
    digest.check_bytes(bytes(10000), entry, "f", "")
    for bad in ({**entry, "bytes": 20000}, {**entry, "segment_bytes": 0}, {**entry, "blake3_segments": "x"},
                {k: v for k, v in entry.items() if k != "bytes"}):
        with pytest.raises(digest.IntegrityError, match="manifest entry"):
            digest.Checker(bad, "f", "")


def test_a_corrupt_segment_falls_back_to_the_previous_checkpoint(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(digest, "SEGMENT", 1024)
    for step in (1, 2):
        saved, progress, ck = _checkpointer(tmp_path, seed=step)
        progress.step = step
        ck.save(step)
        ck.close()
        if step == 1:
            first = saved.weight.detach().clone()
    shard = max((tmp_path / "step-00000002").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    assert len(data) > 2 * 1024
    data[1024 + 7] ^= 0x10  # the second segment
    shard.write_bytes(bytes(data))

    model, progress, ck = _checkpointer(tmp_path, seed=99)
    with caplog.at_level(logging.INFO, logger="azulite.train"):
        assert ck.load_latest() == 1
    assert f"file {shard.name} does not match the manifest (blake3 of bytes [1024, 2048) " in caplog.text
    assert torch.equal(model.weight, first) and progress.step == 1


def test_a_manifest_of_an_unknown_format_is_passed_over_not_quarantined(tmp_path, caplog):
    for step in (1, 2):
        _, progress, ck = _checkpointer(tmp_path, seed=step)
        progress.step = step
        ck.save(step)
        ck.close()
    path = tmp_path / "step-00000002" / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "format": "azulite.checkpoint/3"}))  # a newer azulite's
    _, progress, ck = _checkpointer(tmp_path, seed=99)
    with caplog.at_level(logging.INFO, logger="azulite.train"):
        assert ck.load_latest() == 1
    assert path.exists() and "no valid manifest.json" in caplog.text
