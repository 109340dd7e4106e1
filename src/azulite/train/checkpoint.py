"""Sharded checkpoints with an atomic commit, integrity hashes, retention and resume-latest: the
Checkpointer, which decides when to save and restore and runs the collectives. What it coordinates lives
beside it, one idea per module: ``checkpoint_config`` (how and where to checkpoint), ``staging`` (an async
save's copy of the state), ``commit`` (shards, hashes and the manifest that makes a checkpoint exist),
``restore`` (choosing and verifying the checkpoint to load).

Layout under the checkpoint URI (a directory or ``az://container/path``)::

    step-00000100/
        __0_0.distcp ...          DCP shards: each rank writes its own (FileSystemWriter, one file per
                                  rank and writer thread)
        .metadata                 DCP's index of the shards (written by rank 0)
        hashes-rank00000.json     each rank's digests of the shards it wrote (input to the manifest)
        manifest.json             written LAST: step, world size, model config, BLAKE3 + size of every file,
                                  save_seconds (from save() to the commit)

A step directory without a valid ``manifest.json`` is an interrupted save: it does not exist as a
checkpoint, resume ignores it and retention deletes it. Saves go through ``torch.distributed.checkpoint``
on the Checkpointer's own gloo process group (async saves on the default group hang in torch 2.13); the
commit (sidecars, manifest) runs inside DCP's own protocol — shards in ``write_data`` on every rank, the
manifest in ``finish`` on the coordinator. An async save is DCP's synchronous save of a staged copy of
the state, run in the Checkpointer's own thread (with the storage checks before it), so the training
thread takes part in no collective of the save.

For ``az://`` every rank first writes its shards to a local staging directory (hashing a local file is
cheap, hashing a blob means downloading it), uploads them, then the coordinator uploads the manifest with
``If-None-Match: *``: a single Put Blob that is either entirely there or not at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from azulite.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointUsageError,
    StorageConfigError,
    StorageError,
)
from azulite.train.checkpoint_config import CheckpointConfig
from azulite.train.catalog import WRITER, read_manifest, step_dir
from azulite.train.commit import CommitWriter, PhaseHook, SaveJob
from azulite.train.env import TrainContext
from azulite.train.lifecycle import commit_before_destroy, commit_before_exit, live
from azulite.train.metrics import checkpoint_committed, warm_up
from azulite.train.quiet import single_process_dcp
from azulite.train.reader import VerifyingReader
from azulite.train.restore import Restorer, integrity_messages, state_mismatch
from azulite.train.staging import CachedStager, storage_ptr, updates_in_step, wait_staged_hook
from azulite.train.state import ModelState
from azulite.train.storage import CheckpointStorage, StorageSettings

log = logging.getLogger("azulite.train.checkpoint")

__all__ = ["CheckpointConfig", "Checkpointer", "PhaseHook"]


# --- the Checkpointer ----------------------------------------------------------------------------------
class Checkpointer:
    """Coordinates saving and restoring a job's Stateful objects; it owns no training state itself.

    ``state`` maps names to Stateful objects (see :mod:`azulite.train.state`); the same names must be
    used on resume. Create it on every rank at the same point (it makes a process group).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        ctx: TrainContext,
        state: Mapping[str, Stateful],
        *,
        settings: StorageSettings | None = None,
        environ: Mapping[str, str] | None = None,
        phase_hook: PhaseHook | None = None,
    ) -> None:
        if not isinstance(ctx, TrainContext):
            raise TypeError(f"Checkpointer: ctx must be the TrainContext of azulite.train.init(), got {type(ctx).__name__}")
        if not isinstance(state, Mapping) or not all(isinstance(v, Stateful) for v in state.values()):
            bad = type(state).__name__ if not isinstance(state, Mapping) else \
                next(f"{k!r}: {type(v).__name__}" for k, v in state.items() if not isinstance(v, Stateful))
            raise TypeError(f"Checkpointer: state must map names to savable objects (ModelState, Progress, "
                            f"RNGState, ObjectState, ...), got {bad}; wrap a module as ModelState(model, optimizer)")
        self.config = config
        self.ctx = ctx
        self.state = dict(state)
        self.phase_hook = phase_hook
        if settings is None:
            settings = StorageSettings.from_environ(os.environ if environ is None else environ)
        self.storage = CheckpointStorage(config.uri, settings)  # validates the URI
        self._pg = (dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
                    if ctx.distributed else None)
        self._check_storage()
        self._claim()
        base = settings.staging_dir or os.path.join(tempfile.gettempdir(), "azulite-staging")
        self._staging = Path(base) / hashlib.sha1(self.storage.uri.encode()).hexdigest()[:12]
        self._stager = CachedStager()
        self._restorer = Restorer(self.storage, rank=ctx.rank, staging=self._staging, threads=config.thread_count)
        self._pending: tuple[Future, int, float] | None = None
        self._thread: ThreadPoolExecutor | None = None  # where async saves write
        # optimizers whose step() waits for an async save's background copy (overlap_staging): torch's
        # own, whose step() is where parameters and their state change. Others are not trusted with it
        # (TorchRec's fused optimizers update embeddings in backward): their tensors are copied at save().
        self._waiting_optimizers: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        if config.overlap_staging:
            for obj in self.state.values():
                opt = obj.optimizer if isinstance(obj, ModelState) else None
                if updates_in_step(opt) and opt not in self._waiting_optimizers:
                    self._waiting_optimizers.append(opt)
                    self._hooks.append(opt.register_step_pre_hook(wait_staged_hook(self)))
        commit_before_exit(self)
        live.add(self)
        commit_before_destroy()
        if ctx.is_main:
            warm_up(wait=0)  # the metrics writer connects on its thread (train.init started it already)
        self._failed_in_a_row = 0
        self.last_committed: int | None = None
        #: the manifest of the checkpoint that :meth:`load_latest` restored (None before / when fresh)
        self.loaded_manifest: dict[str, Any] | None = None
        #: what this rank's last restore hashed (files it read that no other rank on its host hashed) and
        #: read straight into tensors, in bytes; with the page cache cold, ``first_read_s``: seconds from
        #: load_latest's start to the disk's first request for the checkpoint's files
        self.last_restore: dict[str, float] = {}
        self._restore_started = 0.0
        #: seconds the training loop was blocked by the last save: all of it for a sync save; for an async
        #: save the copy made before save() returns plus any wait for the background copy at the next
        #: optimizer step (or :meth:`wait_staged`)
        self.last_blocking_s = 0.0

    # -- collectives on the checkpoint group ------------------------------------------------------------
    def _gather(self, obj: Any) -> list[Any]:
        if self._pg is None:
            return [obj]
        out: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, obj, group=self._pg)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if self._pg is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        return box[0]

    def _dcp_call(self) -> contextlib.AbstractContextManager[None]:
        """Around a DCP call: one process saves and loads without a process group on purpose (no_dist),
        which DCP warns about on every call."""
        return single_process_dcp() if self._pg is None else contextlib.nullcontext()

    def _check_storage(self) -> None:
        # rank 0 first (it may create the container), then everyone: each node must reach the storage
        err = None
        if self.ctx.is_main:
            err = _probe(self.storage)
        err = self._broadcast(err)
        if err is None and not self.ctx.is_main:
            err = _probe(self.storage)
        errors = [e for e in self._gather(err) if e]
        if errors:  # as the rank saw it: one wrong as given (permanent) stays so on every rank
            message, fix, permanent = errors[0]
            raise (StorageConfigError if permanent else StorageError)(message, where=self.storage.uri, fix=fix)

    # -- saving -------------------------------------------------------------------------------------------
    def maybe_save(self, step: int) -> bool:
        """Save (async if configured) when ``step`` is a multiple of ``interval``; reap a finished save."""
        self._reap(block=False)
        if self.config.interval and step > 0 and step % self.config.interval == 0:
            return self.save(step, sync=not self.config.async_save)
        return False

    def save(self, step: int, *, sync: bool = True, raise_on_error: bool | None = None) -> bool:
        """Save ``state`` as checkpoint ``step``. Sync: returns True once committed. Async: returns True
        at once; the state is copied (buffers now, parameters and optimizer state before the optimizer's
        next step) and written in the background, and the commit is reaped at a later call. Failures follow ``on_save_error`` unless
        ``raise_on_error`` says otherwise (preemption saves raise: exiting 'preempted' must mean committed).
        """
        if isinstance(step, bool) or not hasattr(step, "__index__") or int(step) < 0:
            # "5", 2.5 or -1 was written as step--0000001/ (listed nowhere) or failed in the failure's own log line
            raise CheckpointUsageError(f"a checkpoint step is a whole number >= 0, got {step!r}",
                                       fix="pass the training step, e.g. ckpt.save(step) with step an int")
        step = int(step)
        t0 = time.perf_counter()
        try:
            return self._save(step, sync, raise_on_error, t0)
        finally:
            self.last_blocking_s = time.perf_counter() - t0

    def _save(self, step: int, sync: bool, raise_on_error: bool | None, t0: float) -> bool:
        self._reap(block=True)  # one save at a time, and every rank reaps at the same step
        if self.phase_hook:
            self.phase_hook("save_start", step)
        if sync:
            try:
                if self._already_committed(step):
                    return True
                with self._dcp_call():
                    dcp.save(self.state, storage_writer=self._writer(step, None, t0), process_group=self._pg,
                             no_dist=self._pg is None)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - DCP wraps every rank's failure in a BaseException
                return self._failed(step, e, raise_on_error)
            self._committed(step, time.perf_counter() - t0)
            return True
        # Async: the training thread only takes the state dicts and copies what forward may change; the
        # rest of the copy, the storage checks (a network round trip on Blob) and their collective, and
        # DCP's save run in the Checkpointer's thread, on its own process group.
        self._stager.deferrable = self._step_owned_storages()
        try:
            finish_copy = self._stager.stage({k: v.state_dict() if isinstance(v, Stateful) else v
                                              for k, v in self.state.items()})
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - e.g. no memory for the staging buffers
            self._stager.owned = None
            return self._failed(step, e, raise_on_error)

        def write() -> CommitWriter | None:
            state_dict, failed = None, None
            try:
                state_dict = finish_copy()
            except Exception as e:  # noqa: BLE001 - told to every rank below, so none waits alone
                failed = f"rank {self.ctx.rank}: copying the state failed: {type(e).__name__}: {e}"
            if self._already_committed(step, failed):
                return None
            writer = self._writer(step, self._stager, t0)
            with self._dcp_call():
                dcp.save(state_dict, storage_writer=writer, process_group=self._pg, no_dist=self._pg is None)
            return writer

        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="azulite-ckpt")
        self._pending = (self._thread.submit(write), step, t0)
        return True

    def _claim(self) -> None:
        """This job writes the location now: ``writer.json`` names it (the main rank; an azulite job only,
        one with an id). A job started later on the same location takes it over, and this one's next save
        stops with the other's name (:meth:`_writer_now`): two jobs saving into one location deleted each
        other's saves in progress and skipped their own steps as "already committed", both exiting 0."""
        env = self.ctx.env
        if env.job_id is None or not self.ctx.is_main:
            return
        try:
            self.storage.write_bytes(WRITER, json.dumps({"job_id": env.job_id, "attempt": env.attempt,
                                                         "since": time.time()}).encode())
        except Exception as e:  # noqa: BLE001 - storage was just checked: a failure here is said, not fatal
            log.warning("could not mark %s as written by job %s: %s", self.storage.uri, env.job_id, e)

    def _writer_now(self) -> str | None:
        """Another job that took the location over since this one claimed it (main rank), or None."""
        mine = self.ctx.env.job_id
        if mine is None or not self.ctx.is_main:
            return None
        try:
            other = json.loads(self.storage.read_bytes(WRITER)).get("job_id")
        except Exception:  # noqa: BLE001 - gone or unreadable: no claim to compare with
            return None
        return other if isinstance(other, str) and other != mine else None

    def _already_committed(self, step: int, failed: str | None = None) -> bool:
        """Before DCP starts, on every rank: is ``step`` committed already (then nothing is saved), and can
        every rank reach the storage (and did it stage the state: ``failed`` says why not)? Decided
        together, so no rank waits in a collective the others skipped; a leftover of an interrupted save
        of the same step is removed."""
        rel = step_dir(step)
        committed, err = False, failed
        try:
            other = self._writer_now() if failed is None else None
            if other is not None:  # before anything of another job's is removed below
                raise CheckpointUsageError(
                    f"job {other} is saving checkpoints to {self.storage.uri} too (it started writing there after "
                    f"job {self.ctx.env.job_id}): two jobs saving into one location remove each other's saves",
                    where=self.storage.uri, fix="give each job its own checkpoint location (outputs.checkpoints.path"
                    ", or CheckpointConfig(uri=...)); resume a job by resubmitting it once the other has ended")
            committed = failed is None and read_manifest(self.storage, rel, step) is not None
            if failed is None and not committed and self.ctx.is_main and self.storage.exists(rel):
                log.warning("removing %s: an interrupted save of the same step", self.storage.display(rel))
                self.storage.remove_tree(rel)
        except CheckpointUsageError as e:  # gathered as its parts: raised again as itself below
            err = (e.message, e.where, e.fix)
        except Exception as e:  # noqa: BLE001 - any storage failure
            err = f"rank {self.ctx.rank}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        verdicts = self._gather((committed, err))
        errors = [e for _, e in verdicts if e]
        if errors:
            if isinstance(errors[0], tuple):  # the location is another job's now: no restart fixes it
                raise CheckpointUsageError(errors[0][0], where=errors[0][1], fix=errors[0][2])
            raise CheckpointError(errors[0])
        if verdicts[0][0]:
            log.info("checkpoint step %d is already committed; not saving it again", step)
            return True
        return False

    def _writer(self, step: int, stager: CachedStager | None, started: float) -> CommitWriter:
        rel = step_dir(step)
        local = Path(self.storage.path(rel)) if not self.storage.remote else self._staging / rel / f"rank-{self.ctx.rank}"
        local.mkdir(parents=True, exist_ok=True)
        job = SaveJob(storage=self.storage, step=step, rank=self.ctx.rank, world_size=self.ctx.world_size,
                       local_dir=local, threads=self.config.thread_count, extra=self._manifest_extra(),
                       hook=self.phase_hook, keep_last=self.config.keep_last, keep_every=self.config.keep_every,
                      started=started)
        return CommitWriter(job, stager)

    def wait(self) -> None:
        """Block until a pending async save is committed (or failed, per the policy)."""
        self._reap(block=True)

    def wait_staged(self) -> None:
        """Block until a pending async save holds its own copy of the state. Optimizers of the saved
        ModelStates do this in a step pre-hook; call it before changing parameters or optimizer state in
        place any other way while a save may be pending (or set ``overlap_staging=False``)."""
        copying = self._stager.copying
        if copying is None or copying.is_set():
            return
        t0 = time.perf_counter()
        copying.wait()  # a failed copy fails the save: reaped per the policy
        self.last_blocking_s += time.perf_counter() - t0

    def _step_owned_storages(self) -> frozenset[int]:
        """Storages of the parameters and optimizer state of optimizers that wait in a step pre-hook."""
        ptrs: set[int | None] = set()
        for opt in self._waiting_optimizers:
            ptrs.update(storage_ptr(p) for group in opt.param_groups for p in group["params"])
            ptrs.update(storage_ptr(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        ptrs.discard(None)
        return frozenset(p for p in ptrs if p)  # 0: an empty storage, shared by all of them

    def close(self) -> None:
        self.wait()
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._waiting_optimizers = [], []
        self._stager.close()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._pg is not None and dist.is_initialized():
            dist.destroy_process_group(self._pg)
            self._pg = None

    def _reap(self, *, block: bool) -> None:
        if self._pending is None:
            return
        fut, step, t0 = self._pending
        # a failure is only acted on at a blocking point (the next save, wait, close), which every rank
        # reaches at the same step: a 'stop' policy then stops all ranks together
        if not block and (not fut.done() or fut.exception() is not None):
            return
        self._pending = None
        try:
            writer = fut.result()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            self._stager.owned = None  # copy everything next time
            self._failed(step, e, None)
            return
        if writer is not None:  # None: the step was committed already
            self._stager.owned = writer.written  # DCP's de-duplication assigns this rank the same tensors again
            self._committed(step, time.perf_counter() - t0)

    def _committed(self, step: int, seconds: float) -> None:
        self._failed_in_a_row = 0
        self.last_committed = step
        log.info("checkpoint step %d committed to %s in %.2fs", step, self.storage.display(step_dir(step)), seconds)
        if self.ctx.is_main:  # save time and age to the job's metrics store: a queue put, any thread
            checkpoint_committed(step, seconds)

    def _failed(self, step: int, exc: BaseException, raise_on_error: bool | None) -> bool:
        if isinstance(exc, CheckpointUsageError):  # never counted and gone on from; nothing removed
            log.error("CHECKPOINT SAVE REFUSED at step %d: %s", step, exc.message)
            raise exc
        self._failed_in_a_row += 1
        reason = _root_cause(exc)
        prev = f"step {self.last_committed}" if self.last_committed is not None else "none yet"
        log.error("CHECKPOINT SAVE FAILED at step %d (%s); nothing was committed for this step; the last "
                  "committed checkpoint is %s", step, reason, prev)
        if self.ctx.is_main and not self.storage.remote and not self._is_committed(step):
            shutil.rmtree(self.storage.path(step_dir(step)), ignore_errors=True)  # never a committed one
        shutil.rmtree(self._staging / step_dir(step), ignore_errors=True)
        stop = raise_on_error if raise_on_error is not None else (
            self.config.on_save_error == "stop" or self._failed_in_a_row >= self.config.max_failed_saves)
        if stop:
            raise CheckpointError(
                f"saving checkpoint step {step} failed ({reason}); {self._failed_in_a_row} failed save(s) in a row",
                where=self.storage.display(step_dir(step)),
                fix="check the storage (space, credentials, endpoint); the job resumes from the last committed "
                f"checkpoint ({prev})",
            ) from exc
        return False

    def _is_committed(self, step: int) -> bool:
        try:
            return read_manifest(self.storage, step_dir(step), step) is not None
        except Exception:  # noqa: BLE001 - storage unreadable: treat as committed, i.e. leave it alone
            return True

    def _manifest_extra(self) -> dict[str, Any]:
        env = self.ctx.env
        return {"model_config": dict(self.config.model_config), "job_id": env.job_id, "attempt": env.attempt}

    # -- restoring ----------------------------------------------------------------------------------------
    def load_latest(self) -> int | None:
        """Restore the newest checkpoint whose files all match their manifest hashes; returns its step,
        or None when there is none (a fresh start). Corrupt or incomplete checkpoints are skipped, and
        the log says which file was wrong and which checkpoint is used instead."""
        self.wait()  # loading writes into the very tensors a pending save may still be copying
        self._restore_started = time.perf_counter()
        while True:
            choice: tuple[int, dict[str, Any]] | dict[str, Any] | None = None
            if self.ctx.is_main:
                try:
                    # sizes now; every byte's hash as it is read (VerifyingReader)
                    choice = self._restorer.choose()
                except CheckpointCorruptError as e:  # every rank raises the same thing
                    choice = {"message": e.message, "fix": e.fix, "corrupt": True}
                except Exception as e:  # noqa: BLE001 - every rank must raise the same thing
                    choice = {"message": f"{type(e).__name__}: {e}", "corrupt": False,
                              "fix": "inspect the checkpoints; delete the directory to start from scratch"}
            choice = self._broadcast(choice)
            if isinstance(choice, dict):  # none intact: exit 78, not restarted into the same (CheckpointCorruptError)
                raise (CheckpointCorruptError if choice["corrupt"] else CheckpointError)(
                    choice["message"], where=self.storage.uri, fix=choice["fix"])
            if choice is None:
                log.info("no committed checkpoint under %s: starting from scratch", self.storage.uri)
                return None
            step, manifest = choice
            try:
                self._load(step, manifest)
            except BaseException as e:  # noqa: BLE001 - DCP gathers every rank's read failure into one
                if state_mismatch(e):  # torch's CheckpointException is no Exception: a user's except missed it
                    raise CheckpointUsageError(
                        f"checkpoint step {step} does not fit this script's state: {_root_cause(e)}",
                        where=self.storage.display(step_dir(step)),
                        fix="resume with the model and state names it was saved with (same architecture, same "
                            "keys of `state=`), or train into a new checkpoint location") from None
                corrupt = integrity_messages(e)
                if not corrupt:
                    raise
                # every rank got the same failure: the checkpoint is corrupt; the previous one is next. One
                # line per corrupt file, whole
                for text in corrupt[1:]:
                    log.warning("checkpoint step %d is corrupt: %s", step, text)
                log.warning("checkpoint step %d is corrupt: %s; falling back to the previous one", step, corrupt[0])
                if self.ctx.is_main:
                    self._restorer.quarantine(step_dir(step))
                continue
            return step

    def _load(self, step: int, manifest: dict[str, Any]) -> None:
        where = self.storage.display(step_dir(step))
        reader = VerifyingReader(self._restorer.restore_dir(step), manifest, self.config.thread_count, where,
                                 fetch=self._restorer.fetcher(step), group=self._pg)
        state = dict(self.state)
        saved_ws = int(manifest["world_size"])
        for name, obj in self.state.items():
            key = getattr(obj, "key", None)
            if key is not None and key.startswith("rank") and self.ctx.rank >= saved_ws:
                log.info("no saved %r for rank %d (checkpoint of world size %d): keeping the seeded one",
                         name, self.ctx.rank, saved_ws)
                state.pop(name)
        try:
            reader.start_prefetch()  # page cache cold: the disk streams while DCP plans
            with self._dcp_call():
                dcp.load(state, storage_reader=reader, process_group=self._pg, no_dist=self._pg is None)
        finally:
            reader.stop_prefetch()  # a load that failed between its plan and its reads
            self._restorer.discard(step)  # this rank's downloaded copy only
        self.last_restore = {"hashed_bytes": reader.hashed_bytes, "direct_bytes": reader.direct_bytes}
        if reader.first_read_at is not None:  # a cold read: how long the disk waited for its first request
            self.last_restore["first_read_s"] = reader.first_read_at - self._restore_started
        if reader.stream_ended_at is not None and reader.reads_done_at is not None:
            # a cold read's tail: the readers' copy and hash of what the disk brought last
            self.last_restore["readers_behind_stream_s"] = reader.reads_done_at - reader.stream_ended_at
        self.loaded_manifest = manifest
        self.last_committed = step
        if saved_ws != self.ctx.world_size:
            log.info("checkpoint step %d was saved by %d rank%s, loaded on %d", step, saved_ws,
                     "s" if saved_ws != 1 else "", self.ctx.world_size)
        log.info("resumed from checkpoint step %d (%s)", step, where)

def _probe(storage: CheckpointStorage) -> tuple[str, str, bool] | None:
    try:
        storage.check()
    except StorageError as e:
        return (e.message, e.fix or "", e.permanent)
    return None


def _root_cause(exc: BaseException) -> str:
    """DCP wraps rank failures in CheckpointException(failures={rank: exc}); name the first real one."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(sorted(failures.items())))
        inner_exc = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner_exc, CheckpointError):
            return inner_exc.message
        return f"rank {rank}: {type(inner_exc).__name__}: {str(inner_exc).splitlines()[0][:300] if str(inner_exc) else ''}"
    text = str(exc).splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"
