"""The Checkpointer in one process: manifest, retention, listing, resharding 2 -> 1 rank, policies."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import blake3
import pytest
import torch

from azulite.errors import CheckpointError, StorageError
from azulite.train import (
    EXIT_CONFIG,
    CheckpointConfig,
    Checkpointer,
    ModelState,
    ObjectState,
    Progress,
    ResumableSampler,
    RNGState,
    exit_code,
    init,
    list_checkpoints,
)
from tests.train.conftest import STEPS, runner
from tests.train.procs import ROOT, base_env
from tests.train.scripts import fsdp_async, toy_train


_ = runner  # fixture
REPLICATED = ROOT / "tests" / "train" / "scripts" / "replicated_async.py"
FSDP = ROOT / "tests" / "train" / "scripts" / "fsdp_async.py"


def _state(ctx, model, opt, **extra):
    return {"model": ModelState(model, opt), "progress": Progress(), "rng": RNGState(ctx), **extra}


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_manifest_lists_every_file_with_its_hash(tmp_path):
    ctx = init({})
    model, opt = _tiny()
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path), model_config={"d": 4}), ctx, _state(ctx, model, opt))
    t0 = time.perf_counter()
    assert ck.save(3)
    elapsed = time.perf_counter() - t0
    step = tmp_path / "step-00000003"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 1 and manifest["model_config"] == {"d": 4}
    # the duration of this save (the interval planner's checkpoint cost): within the save() call
    assert 0 < manifest["save_seconds"] <= elapsed
    on_disk = {p.name for p in step.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk and ".metadata" in on_disk
    for name, entry in manifest["files"].items():
        data = (step / name).read_bytes()
        assert entry == {"blake3": blake3.blake3(data).hexdigest(), "bytes": len(data)}
    assert torch.serialization.get_crc32_options()  # shards skip torch.save's CRC32 in the writer only


def test_retention_keep_last_and_keep_every(tmp_path):
    ctx = init({})
    model, opt = _tiny()
    progress = Progress()
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path), interval=1, keep_last=2, keep_every=4, async_save=True),
                      ctx, {"model": ModelState(model, opt), "progress": progress})
    (tmp_path / "step-00000002").mkdir()  # an interrupted save from an earlier attempt
    for step in range(1, 11):
        progress.step = step
        ck.maybe_save(step)
    ck.close()
    assert [(c.step, c.committed) for c in list_checkpoints(str(tmp_path))] == [
        (4, True), (8, True), (9, True), (10, True)]
    assert ck.last_committed == 10


def test_a_failed_save_never_deletes_a_step_another_writer_committed(tmp_path):
    # a second writer (a stale attempt) commits the same step between our shards and our manifest: our
    # If-None-Match commit fails, and cleaning up after that failure must leave its checkpoint alone
    ctx = init({})
    model, opt = _tiny()
    other = tmp_path / "other"
    Checkpointer(CheckpointConfig(uri=str(other)), ctx, _state(ctx, model, opt)).save(5)
    ours = tmp_path / "ours"

    def commit_first(phase, step):
        if phase == "before_manifest":
            (ours / "step-00000005" / "manifest.json").write_bytes((other / "step-00000005" / "manifest.json").read_bytes())

    ck = Checkpointer(CheckpointConfig(uri=str(ours)), ctx, _state(ctx, model, opt), phase_hook=commit_first)
    assert ck.save(5, raise_on_error=False) is False
    assert [(c.step, c.committed) for c in list_checkpoints(str(ours))] == [(5, True)]


def test_listing_unreachable_blob_storage_is_a_storage_error(tmp_path):
    dead = "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=a2V5;BlobEndpoint=http://127.0.0.1:9/devstoreaccount1;"
    with pytest.raises(StorageError) as e:
        list_checkpoints("az://ckpts/run", environ={"AZURE_STORAGE_CONNECTION_STRING": dead, "AZULITE_STORAGE_RETRIES": "0"})
    assert "cannot list checkpoints under az://ckpts/run" in e.value.message and e.value.fix


def test_list_checkpoints_reports_partial_ones(tmp_path):
    ctx = init({})
    model, opt = _tiny()
    Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, model, opt)).save(5)
    partial = tmp_path / "step-00000007"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x" * 100)
    infos = list_checkpoints(str(tmp_path))
    assert [(c.step, c.committed) for c in infos] == [(5, True), (7, False)]
    assert infos[0].bytes > 1000 and infos[1].bytes == 100
    assert infos[0].uri == str(tmp_path / "step-00000005")
    assert list_checkpoints(str(tmp_path / "nothing-here")) == []
    # a file named like a step is no step: it failed listing and every resume with NotADirectoryError
    (tmp_path / "step-00000099").write_text("junk")
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [5, 7]
    assert Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, *_tiny())).load_latest() == 5


def test_two_rank_checkpoint_loads_on_one_rank(baseline, caplog):
    """(f) The baseline's 2-rank DDP checkpoint, loaded by one process without a process group."""
    ctx = init({})
    model = toy_train.build_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=8, gamma=0.7)
    sampler, progress = ResumableSampler(toy_train.DATASET, ctx, seed=7), Progress()
    state = {"model": ModelState(model, opt), "sched": ObjectState(sched), "data": sampler,
             "progress": progress, "rng": RNGState(ctx)}
    with caplog.at_level(logging.INFO, logger="azulite.train"):
        ck = Checkpointer(CheckpointConfig(uri=str(baseline["ckpt"])), ctx, state)
        assert ck.load_latest() == STEPS
    assert toy_train.params_sha256(model) == baseline["sha256"]
    assert progress.step == STEPS and sched.last_epoch == STEPS
    assert int(opt.state_dict()["state"][0]["step"]) == STEPS
    assert ck.loaded_manifest["world_size"] == 2 and ck.loaded_manifest["model_config"] == {"layers": toy_train.LAYERS}
    assert "saved by 2 ranks, loaded on 1" in caplog.text


def test_all_checkpoints_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    ctx = init({})
    model, opt = _tiny()
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, model, opt))
    ck.save(1)
    shard = next((tmp_path / "step-00000001").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    for _ in range(2):  # and again on the next attempt, once the corrupt one was un-committed
        with pytest.raises(CheckpointError, match="none of the 1 committed checkpoint"):
            Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, model, opt)).load_latest()


def _two_steps(tmp_path):
    """Steps 1 and 2 of the tiny model committed under ``tmp_path``; the context they were saved in."""
    ctx = init({})
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, *_tiny()))
    ck.save(1)
    ck.save(2)
    ck.wait()
    return ctx


def test_a_damaged_manifest_is_corruption_not_an_interrupted_save(tmp_path, caplog):
    """A manifest cut in half (written whole or not at all: this is damage) was read as an interrupted save:
    with every step's damaged, training started over and its saves then removed the good shards."""
    ctx = _two_steps(tmp_path)
    damaged = tmp_path / "step-00000002" / "manifest.json"
    damaged.write_bytes(damaged.read_bytes()[: len(damaged.read_bytes()) // 2])
    with caplog.at_level(logging.WARNING, logger="azulite.train"):
        assert Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, *_tiny())).load_latest() == 1
    assert "checkpoint step 2 is corrupt: its manifest.json is not a valid manifest" in caplog.text
    assert (tmp_path / "step-00000002" / "manifest.corrupt.json").is_file()  # the evidence, un-committed
    first = tmp_path / "step-00000001" / "manifest.json"
    first.write_text("{")
    with pytest.raises(CheckpointError, match="none of the 2 committed checkpoint"):
        Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, *_tiny())).load_latest()
    assert next((tmp_path / "step-00000001").glob("*.distcp")).is_file()  # nothing of it removed


def test_a_tampered_metadata_file_falls_back_to_the_previous_step(tmp_path, caplog):
    """DCP reads .metadata catching every error and raises an AssertionError of their text: the integrity
    failure inside was not recognised, and the resume stopped with a traceback instead of falling back."""
    ctx = _two_steps(tmp_path)
    meta = tmp_path / "step-00000002" / ".metadata"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size: only its hash tells
    meta.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="azulite.train"):
        assert Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, *_tiny())).load_latest() == 1
    assert "checkpoint step 2 is corrupt" in caplog.text and "falling back to the previous one" in caplog.text


def test_a_second_job_saving_into_the_location_stops_the_first(tmp_path):
    """Two jobs saving into one location removed each other's saves in progress and skipped their own steps
    as "already committed" by the other, both exiting 0. The job that started writing there last keeps it;
    the other's next save is refused, naming it, with the exit of a mistake no restart fixes."""
    from azulite.errors import CheckpointUsageError

    first_ctx, second_ctx = init({"AZULITE_JOB_ID": "first-1"}), init({"AZULITE_JOB_ID": "second-1"})
    first = Checkpointer(CheckpointConfig(uri=str(tmp_path)), first_ctx, _state(first_ctx, *_tiny()))
    assert first.save(1, sync=True)
    second = Checkpointer(CheckpointConfig(uri=str(tmp_path)), second_ctx, _state(second_ctx, *_tiny()))
    with pytest.raises(CheckpointUsageError, match="job second-1 is saving checkpoints to") as e:
        first.save(2, sync=True)
    assert exit_code(e.value) == EXIT_CONFIG and not (tmp_path / "step-00000002").exists()
    assert second.save(2, sync=True)
    again = init({"AZULITE_JOB_ID": "second-1", "AZULITE_ATTEMPT": "2"})  # the same job's next attempt
    assert Checkpointer(CheckpointConfig(uri=str(tmp_path)), again, _state(again, *_tiny())).save(3, sync=True)
    assert second.save(4, sync=True)


def test_a_sampler_resumed_over_another_dataset_is_refused(tmp_path):
    """Saved over 1000 samples, resumed over 100: the saved position was past the end, and the sampler
    yielded an empty epoch without a word."""
    from azulite.errors import CheckpointUsageError

    ctx = init({})
    model, opt = _tiny()
    sampler = ResumableSampler(1000, ctx)
    sampler.advance(160)
    Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, model, opt, data=sampler)).save(1, sync=True)
    smaller = ResumableSampler(100, ctx)
    with pytest.raises(CheckpointUsageError, match="over 1000 samples; this script's has 100"):
        Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, *_tiny(), data=smaller)).load_latest()
    same = ResumableSampler(1000, ctx)
    assert Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, *_tiny(), data=same)).load_latest() == 1
    assert same.consumed == 160


def test_fresh_directory_starts_from_scratch(tmp_path):
    ctx = init({})
    model, opt = _tiny()
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path / "new")), ctx, _state(ctx, model, opt))
    assert ck.load_latest() is None and ck.loaded_manifest is None


def test_async_save_snapshots_the_state_and_round_trips(tmp_path):
    ctx = init({})
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, model, opt))
    before = [p.detach().clone() for p in model.parameters()]
    ck.save(1, sync=False)
    model(torch.randn(2, 512)).sum().backward()  # training goes on while the save writes
    opt.step()
    ck.wait()
    assert ck.last_committed == 1 and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model2 = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    ck2 = Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, model2, torch.optim.Adam(model2.parameters())))
    assert ck2.load_latest() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))


def _hold_background_copies(ck) -> threading.Event:
    """White box: occupy the Checkpointer's save thread until the returned event is set, so a save's
    background copy is certainly still pending when training goes on."""
    release = threading.Event()
    ck._thread = ThreadPoolExecutor(max_workers=1)
    ck._thread.submit(release.wait, 300)  # a safety net only: every test sets it
    return release


class _ReleaseOnWait:
    """White box, in place of a pending save's ``_stager.copying``: the held save thread is released only
    when the training thread starts waiting for the copy. So the copy can be done before a step only if
    that step waited for it: an ordering, not a duration."""

    def __init__(self, copying: threading.Event, release: threading.Event) -> None:
        self.copying, self.release = copying, release

    def is_set(self) -> bool:
        return self.copying.is_set()

    def wait(self, timeout=None) -> bool:
        self.release.set()
        return self.copying.wait(timeout)


def _bn_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    return model, opt


def _loaded_state(ctx, uri):
    model, opt = _bn_model()
    ck = Checkpointer(CheckpointConfig(uri=uri), ctx, _state(ctx, model, opt))
    ck.load_latest()
    return {k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()["state"]


def test_async_save_copies_parameters_while_training_goes_on_and_step_waits_for_the_copy(tmp_path):
    """Parameters and optimizer state are copied in the background; buffers (which forward changes)
    before save() returns; the optimizer's next step() waits for the copy, so the checkpoint holds the
    state of its step exactly, and that wait counts as blocking."""
    ctx = init({})
    model, opt = _bn_model()
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, model, opt))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_exp_avg = opt.state_dict()["state"][0]["exp_avg"].clone()
    release = _hold_background_copies(ck)
    try:
        ck.save(1, sync=False)
        copying = ck._stager.copying
        assert not copying.is_set()  # save() returned before the copy
        ck._stager.copying = _ReleaseOnWait(copying, release)
        deferred = ck._stager.deferred
        assert {"model.model.0.weight", "model.optim.state.0.weight.exp_avg"} <= deferred
        assert not any("running_mean" in k for k in deferred)
        model(torch.randn(8, 64)).square().mean().backward()  # forward changes the BatchNorm statistics
        assert not copying.is_set()  # forward and backward ran beside the pending copy
        # a step pre-hook registered after the Checkpointer's runs once that one has returned
        at_step = []
        handle = opt.register_step_pre_hook(lambda *_: at_step.append(copying.is_set()))
        blocked_in_save = ck.last_blocking_s
        opt.step()  # waits for the copy
        handle.remove()
        assert at_step == [True]  # the step began only once the copy was done
        assert ck.last_blocking_s > blocked_in_save  # and that wait counts as blocking
    finally:
        release.set()
    ck.wait()
    assert not torch.equal(model[1].running_mean, saved["1.running_mean"])
    loaded, optim = _loaded_state(ctx, str(tmp_path))
    assert all(torch.equal(loaded[k], saved[k]) for k in saved), [k for k in saved if not torch.equal(loaded[k], saved[k])]
    assert torch.equal(optim[0]["exp_avg"], saved_exp_avg)
    ck.close()
    assert not opt._optimizer_step_pre_hooks  # close() takes its hook off the optimizer


def test_changes_outside_the_optimizer_wait_with_wait_staged_or_overlap_off(tmp_path):
    ctx = init({})
    for overlap in (True, False):
        model, opt = _bn_model()
        uri = str(tmp_path / str(overlap))
        ck = Checkpointer(CheckpointConfig(uri=uri, overlap_staging=overlap), ctx, _state(ctx, model, opt))
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        release = _hold_background_copies(ck)
        try:
            ck.save(1, sync=False)
            assert bool(ck._stager.deferred) is overlap
            if overlap:
                ck._stager.copying = _ReleaseOnWait(ck._stager.copying, release)
            ck.wait_staged()  # a no-op without overlap
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        finally:
            release.set()
        ck.close()
        loaded, _ = _loaded_state(ctx, uri)
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.mark.slow
def test_replicated_async_saves_copy_only_what_each_rank_writes_and_stay_snapshots(runner, tmp_path):
    """DDP state on 3 ranks: from the second async save on, each rank copies only the tensors DCP has it
    write (together: every tensor, once), and each checkpoint still loads to the values of its step."""
    res = runner.run(["--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")], nproc=3,
                     script=REPLICATED)
    assert res.returncode == 0, res.output[-4000:]
    ranks = [json.loads((tmp_path / "out" / f"rank-{r}.json").read_text()) for r in range(3)]
    tensors = set(ranks[0]["tensors"])
    assert all(r["copied"][0] is None for r in ranks)  # the first save copies everything
    for save in (1, 2):
        parts = [set(r["copied"][save]) for r in ranks]
        assert all(p and p < tensors for p in parts), parts
        assert sum(len(p) for p in parts) == len(tensors) and set().union(*parts) == tensors
    assert all(r["loaded"] == {"3": True, "2": True} for r in ranks), ranks


def test_only_torch_optimizers_are_trusted_to_change_tensors_in_step_alone(tmp_path):
    """An optimizer from elsewhere may update in backward (TorchRec's fused ones): its parameters are
    copied before save() returns, not while training goes on."""

    class FusedLike(torch.optim.SGD):  # not from torch.optim: could update anywhere
        pass

    ctx = init({})
    model, _ = _bn_model()
    for opt, deferred in ((torch.optim.SGD(model.parameters(), lr=0.1), True),
                          (FusedLike(model.parameters(), lr=0.1), False)):
        ck = Checkpointer(CheckpointConfig(uri=str(tmp_path / str(deferred))), ctx, _state(ctx, model, opt))
        ck.save(1, sync=False)
        assert ("model.model.0.weight" in ck._stager.deferred) is deferred
        assert bool(opt._optimizer_step_pre_hooks) is deferred
        ck.close()


def test_a_background_copy_that_fails_fails_that_save_only(tmp_path, caplog):
    ctx = init({})
    model, opt = _bn_model()
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, model, opt))
    copy = ck._stager._copy

    def failing(part):  # white box: the copy made in the background thread runs out of memory
        if threading.current_thread() is not threading.main_thread():
            raise MemoryError("no memory for the staging buffers")
        return copy(part)

    ck._stager._copy = failing
    with caplog.at_level(logging.ERROR, logger="azulite.train"):
        assert ck.save(1, sync=False)
        ck.wait()
    assert ck.last_committed is None and "copying the state failed: MemoryError" in caplog.text
    assert not (tmp_path / "step-00000001").exists()
    ck._stager._copy = copy
    ck.save(2, sync=False)
    ck.close()
    assert ck.last_committed == 2


def test_a_script_that_ends_without_close_still_commits_its_last_async_save(tmp_path):
    script = ROOT / "tests" / "train" / "scripts" / "exit_without_close.py"
    res = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=base_env())
    assert res.returncode == 0, res.stderr[-3000:]
    assert [c.step for c in list_checkpoints(str(tmp_path)) if c.committed] == [1], res.stderr[-3000:]


def test_a_script_that_destroys_its_process_group_without_close_still_commits(runner, tmp_path):
    res = runner.run([str(tmp_path / "ck")], script=ROOT / "tests" / "train" / "scripts" / "exit_after_destroy.py")
    assert res.returncode == 0, res.output[-3000:]
    # each rank had gone on alone ("torch.distributed is disabled ... save in a single process"), and one
    # failed its commit: what was left was no checkpoint of the two ranks
    assert "SAVE FAILED" not in res.output and "torch.distributed is disabled" not in res.output, res.output[-3000:]
    assert [c.step for c in list_checkpoints(str(tmp_path / "ck")) if c.committed] == [1], res.output[-3000:]
    manifest = json.loads((tmp_path / "ck" / "step-00000001" / "manifest.json").read_text())
    assert manifest["world_size"] == 2


@pytest.mark.slow
def test_fsdp2_sharded_state_saves_async_and_loads_on_two_ranks_and_on_one(runner, tmp_path):
    """FSDP2 on 2 CPU ranks: parameters and Adam state are DTensor shards; an async save copies them in
    the background while the next step runs, and the checkpoint loads into a fresh sharded model and,
    resharded, into a plain model in one process."""
    res = runner.run(["--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")], nproc=2, script=FSDP)
    assert res.returncode == 0, res.output[-4000:]
    for r in range(2):
        out = json.loads((tmp_path / "out" / f"rank-{r}.json").read_text())
        assert out["moved"] and out["loaded_step"] == 2 and out["equal"], out
        assert "model.model.0.weight" in out["deferred"] and "model.optim.state.0.weight.exp_avg" in out["deferred"]
    saved = torch.load(tmp_path / "out" / "saved.pt")
    model = fsdp_async.plain_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ctx = init({})
    state = {"model": ModelState(model, opt), "progress": Progress()}
    assert Checkpointer(CheckpointConfig(uri=str(tmp_path / "ckpt")), ctx, state).load_latest() == 2
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_a_save_that_would_write_a_tensor_it_did_not_copy_fails_instead(tmp_path, caplog):
    ctx = init({})
    model, opt = _tiny()
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, model, opt))
    ck.save(1, sync=False)
    ck.wait()
    ck._stager.owned = frozenset()  # as if DCP had planned this rank's writes differently last time
    with caplog.at_level(logging.ERROR, logger="azulite.train"):
        ck.save(2, sync=False)
        ck.wait()
    assert ck.last_committed == 1 and "did not copy" in caplog.text
    assert [c.step for c in list_checkpoints(str(tmp_path)) if c.committed] == [1]
    ck.save(3, sync=False)  # and the next save copies everything again
    ck.wait()
    assert ck.last_committed == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"keep_last": 0}, "keep_last"), ({"interval": -1}, "interval"), ({"on_save_error": "ignore"}, "on_save_error"),
     ({"model_config": {"f": object()}}, "model_config")],
)
def test_config_is_validated_when_built(kwargs, field):
    with pytest.raises(CheckpointError) as info:
        CheckpointConfig(uri="/tmp/x", **kwargs)
    assert info.value.where == f"CheckpointConfig.{field}"


def test_missing_file_is_detected_logged_and_previous_used(tmp_path, caplog):
    ctx = init({})
    model, opt = _tiny()
    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, model, opt))
    ck.save(1)
    saved = [p.clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ck.save(2)
    shard = next((tmp_path / "step-00000002").glob("*.distcp"))
    shard.unlink()
    model2, opt2 = _tiny()
    with caplog.at_level(logging.INFO, logger="azulite.train"):
        assert Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, model2, opt2)).load_latest() == 1
    assert f"checkpoint step 2 is corrupt: file {shard.name} is missing" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(saved, model2.parameters()))
    assert [(c.step, c.committed) for c in list_checkpoints(str(tmp_path))] == [(1, True), (2, False)]


def test_max_failed_saves_in_a_row_escalates_to_an_error(tmp_path):
    """on_save_error="continue": failed saves are logged and training goes on, until max_failed_saves in a
    row; a save that succeeds in between starts the count again."""
    ctx = init({})
    model, opt = _tiny()
    fault = {"on": True}

    def disk_full(phase, step):
        if fault["on"] and phase == "before_manifest":
            raise OSError(28, "No space left on device")

    ck = Checkpointer(CheckpointConfig(uri=str(tmp_path), max_failed_saves=2), ctx, _state(ctx, model, opt),
                      phase_hook=disk_full)
    assert ck.save(1) is False
    fault["on"] = False
    assert ck.save(2)
    fault["on"] = True
    assert ck.save(3) is False
    with pytest.raises(CheckpointError, match=r"saving checkpoint step 4 failed .*2 failed save\(s\) in a row"):
        ck.save(4)
    assert [c.step for c in list_checkpoints(str(tmp_path)) if c.committed] == [2]
    ck.close()


def test_a_step_that_is_not_a_whole_number_is_refused_before_anything_is_written(tmp_path):
    # "5" failed inside the failure's own log line; 2.5 was logged as step 2; -1 wrote step--0000001/
    ctx = init({})
    model, opt = _tiny()
    ck = Checkpointer(CheckpointConfig(uri=tmp_path, interval=0), ctx, _state(ctx, model, opt))  # a Path works
    for bad in ("5", 2.5, -1, True):
        with pytest.raises(CheckpointError, match="a checkpoint step is a whole number >= 0"):
            ck.save(bad)
    assert not list(tmp_path.iterdir())
    assert ck.save(torch.tensor(4).item()) and (tmp_path / "step-00000004" / "manifest.json").exists()


def test_resuming_into_a_different_model_names_the_mismatch(tmp_path):
    # torch's CheckpointException (a BaseException) escaped a user's `except Exception` as a nested traceback
    ctx = init({})
    model, opt = _tiny()
    assert Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, _state(ctx, model, opt)).save(2)
    wider = torch.nn.Linear(5, 2)
    other = Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx,
                         _state(ctx, wider, torch.optim.SGD(wider.parameters(), lr=0.1)))
    with pytest.raises(CheckpointError) as e:
        other.load_latest()
    assert "checkpoint step 2 does not fit this script's state" in e.value.message and "Size mismatch" in e.value.message
    assert exit_code(e.value) == EXIT_CONFIG  # the same on every restart: the job fails at once (it exited 1)
    assert (tmp_path / "step-00000002" / "manifest.json").exists()  # not quarantined: the checkpoint is fine
    with pytest.raises(CheckpointError, match="Missing key in checkpoint"):
        Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, {"modle": ModelState(model)}).load_latest()


def test_wrong_arguments_to_the_state_objects_are_named(tmp_path):
    # each was accepted and failed later inside torch (or as 'NoneType' has no attribute 'distributed')
    ctx = init({})
    model, opt = _tiny()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        ModelState("model")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or None, got str"):
        ModelState(model, "adam")
    with pytest.raises(TypeError, match="dataset_len must be a whole number >= 0, got -5"):
        ResumableSampler(-5, ctx)
    with pytest.raises(TypeError, match="ctx must be the TrainContext"):
        ResumableSampler(100, None)
    with pytest.raises(TypeError, match=r"state must map names to savable objects .*got list"):
        Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, [ModelState(model)])  # cannot convert dictionary update...
    with pytest.raises(TypeError, match=r"got 'rng': int; wrap a module as ModelState"):
        Checkpointer(CheckpointConfig(uri=str(tmp_path)), ctx, {"model": ModelState(model), "rng": 7})
    with pytest.raises(TypeError, match="ctx must be the TrainContext"):
        Checkpointer(CheckpointConfig(uri=str(tmp_path)), None, {"model": ModelState(model)})
    assert ResumableSampler(torch.tensor(8).numpy(), ctx).dataset_len == 8  # a numpy whole number is one
