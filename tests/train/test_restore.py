"""Choosing the checkpoint to restore, in one process: what a corrupt one says (one whole line per file, no
traceback), and the exit of a location where none is intact; DCP's single-process warning, silenced for
azulite's own calls only."""

from __future__ import annotations

import logging
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from azulite.contract import EXIT_CONFIG
from azulite.errors import CheckpointCorruptError
from azulite.train import CheckpointConfig, Checkpointer, ModelState, Progress, exit_code, init
from azulite.train.restore import integrity_messages


def _state(ctx):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return {"model": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1)), "progress": Progress()}


def _tamper(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size: only its hash tells
    path.write_bytes(bytes(data))


def test_a_tampered_metadata_file_is_one_whole_line_and_none_intact_exits_78(tmp_path, caplog):
    """The only committed step with a tampered .metadata printed two tracebacks into the rank's log (DCP's
    "Global metadata is not found", then "__0.metadata is not in the manifest"), a summary cut at 300
    characters in the middle of the path, and exited 1: restarted into the same error."""
    uri = tmp_path / ("a-long-folder-name-" * 8) / ("another-long-one-" * 8) / "ckpt"  # > 300 characters
    ctx = init({})
    Checkpointer(CheckpointConfig(uri=str(uri)), ctx, _state(ctx)).save(2)
    _tamper(uri / "step-00000002" / ".metadata")
    caplog.set_level(logging.WARNING)  # every logger: DCP's are the root logger
    with pytest.raises(CheckpointCorruptError) as e:
        Checkpointer(CheckpointConfig(uri=str(uri)), ctx, _state(ctx)).load_latest()
    assert e.value.message == f"none of the 1 committed checkpoint(s) under {uri} is intact"
    assert exit_code(e.value) == EXIT_CONFIG and "manifest.corrupt.json" in e.value.fix
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    said = [r.getMessage() for r in caplog.records]
    corrupt = [m for m in said if m.startswith("checkpoint step 2 is corrupt: ")]
    assert len(corrupt) == 1, said
    assert corrupt[0].startswith("checkpoint step 2 is corrupt: file .metadata does not match the manifest (blake3 ")
    assert corrupt[0].endswith(f"[{uri}/step-00000002]; falling back to the previous one")
    assert not [m for m in said if "__0.metadata" in m or "metadata is not found" in m or "found corrupt" in m]
    # the next attempt finds the same: un-committed, still not intact, the same exit
    with pytest.raises(CheckpointCorruptError):
        Checkpointer(CheckpointConfig(uri=str(uri)), ctx, _state(ctx)).load_latest()


def test_a_corrupt_shard_beside_an_intact_step_still_falls_back(tmp_path, caplog):
    ctx = init({})
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx))
    ck.save(1)
    ck.save(2)
    shard = next((tmp_path / "step-00000002").glob("*.distcp"))
    _tamper(shard)
    with caplog.at_level(logging.WARNING):
        assert Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx)).load_latest() == 1
    assert f"checkpoint step 2 is corrupt: file {shard.name} does not match the manifest" in caplog.text
    assert not [r for r in caplog.records if r.exc_info]


def test_integrity_messages_are_whole_and_one_per_file():
    from azulite.train.digest import IntegrityError

    where = "/x/" + "y" * 400 + "/step-00000002"
    meta = f"file .metadata does not match the manifest (blake3 aa.. 1 B, expected bb.. 1 B) [{where}]"

    class Failure(Exception):
        def __init__(self, failures):
            self.failures = failures

    joined = AssertionError(f"metadata is None; global metadata read failed: {meta}; rank local metadata read "
                            "failed: file __0.metadata is not in the manifest [x]")
    shard = IntegrityError("file __1_0.distcp is missing", where=where)
    assert integrity_messages(Failure({0: joined, 1: (joined, "tb"), 2: shard})) == [
        meta, f"file __1_0.distcp is missing [{where}]"]
    assert integrity_messages(AssertionError("metadata is None; global metadata read failed: boom")) == []
    assert integrity_messages(ValueError("Size mismatch")) == []


def _single_process_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "assuming the intent is to" in str(w.message)]


def test_dcps_single_process_warning_is_silenced_for_azulites_calls_only(tmp_path):
    """Every save and load of a one-process run printed torch's "torch.distributed is disabled ... assuming the
    intent is to save in a single process", which the Checkpointer asks for on purpose. An async save calls
    DCP on the Checkpointer's thread: silenced there too, without touching what other threads see."""
    ctx = init({})
    state = _state(ctx)
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path / "ck")), ctx, state)

    def save_and_load():
        ck.save(1)  # sync
        ck.save(2, sync=False)  # async, on the Checkpointer's thread
        ck.wait()
        Checkpointer(CheckpointConfig(uri=str(tmp_path / "ck")), ctx, _state(ctx)).load_latest()

    assert _single_process_warnings(save_and_load) == []
    # a script's own DCP call, here or in another thread, still gets torch's warning as torch gives it
    own = {"w": torch.zeros(2)}
    assert len(_single_process_warnings(lambda: dcp.save(own, checkpoint_id=str(tmp_path / "own1"), no_dist=True))) == 1
    seen: list[str] = []

    def other_thread():
        seen.extend(_single_process_warnings(lambda: dcp.save(own, checkpoint_id=str(tmp_path / "own2"),
                                                              no_dist=True)))

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert len(seen) == 1
    ck.close()
