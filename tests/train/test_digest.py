"""Manifest digests: new checkpoints record BLAKE3; a manifest written with sha256 (before) is still
verified with sha256, and a corrupt file is still found."""

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


def _to_sha256(step_dir):
    """Rewrite a manifest the way manifests were written before BLAKE3: sha256 of every file."""
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    for name, entry in manifest["files"].items():
        data = (step_dir / name).read_bytes()
        assert entry == {"blake3": blake3.blake3(data).hexdigest(), "bytes": len(data)}
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    path.unlink()
    path.write_text(json.dumps(manifest))


def test_a_sha256_manifest_is_verified_with_sha256(tmp_path, caplog):
    for step in (1, 2):
        saved, progress, ck = _checkpointer(tmp_path, seed=step)
        progress.step = step
        ck.save(step)
        ck.close()
        _to_sha256(tmp_path / f"step-{step:08d}")
        if step == 1:
            first = saved.weight.detach().clone()
    shard = next((tmp_path / "step-00000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))

    model, progress, ck = _checkpointer(tmp_path, seed=99)
    with caplog.at_level(logging.INFO, logger="azulite.train"):
        assert ck.load_latest() == 1
    assert f"file {shard.name} does not match the manifest (sha256 " in caplog.text
    assert torch.equal(model.weight, first) and progress.step == 1


def test_an_entry_without_a_known_digest_is_an_integrity_error():
    assert digest.algorithm_of({"sha256": "ab", "bytes": 1}) == "sha256"
    with pytest.raises(digest.IntegrityError, match="has no digest"):
        digest.algorithm_of({"md5": "ab", "bytes": 1})
