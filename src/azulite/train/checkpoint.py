"""Sharded checkpoints with an atomic commit, integrity hashes, retention and resume-latest.

Layout under the checkpoint URI (a directory or ``az://container/path``)::

    step-00000100/
        __0_0.distcp ...          DCP shards: each rank writes its own (FileSystemWriter, one file per
                                  rank and writer thread)
        .metadata                 DCP's index of the shards (written by rank 0)
        hashes-rank00000.json     each rank's sha256 of the shards it wrote (input to the manifest)
        manifest.json             written LAST: step, world size, model config, sha256 + size of every file

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
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.stateful import Stateful
from torch.futures import Future as TorchFuture
from torch.utils.serialization import config as serialization_config

from azulite.errors import CheckpointError, StorageError
from azulite.train.catalog import MANIFEST, MANIFEST_FORMAT, read_manifest, scan_steps, step_dir
from azulite.train.env import TrainContext
from azulite.train.state import ModelState
from azulite.train.storage import CheckpointStorage, StorageSettings

log = logging.getLogger("azulite.train.checkpoint")

#: Called with (phase, step) at the points where a failure matters: "save_start" on every rank before a
#: save touches storage, "shards_written" on every rank after its local shards are on disk (before
#: upload), "before_manifest" on rank 0 before the commit. A seam for
#: fault-injection tests and telemetry.
PhaseHook = Callable[[str, int], None]


def _sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)  # hashlib releases the GIL on large buffers: files hash in parallel threads
    return h.hexdigest()


def _hash_files(paths: Mapping[str, Path], threads: int) -> dict[str, dict[str, Any]]:
    def one(name: str) -> tuple[str, dict[str, Any]]:
        p = paths[name]
        return name, {"sha256": _sha256_file(p), "bytes": p.stat().st_size}

    if threads <= 1 or len(paths) <= 1:
        return dict(map(one, sorted(paths)))
    with ThreadPoolExecutor(max_workers=min(threads, len(paths))) as pool:
        return dict(pool.map(one, sorted(paths)))


# --- configuration -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How and where a job checkpoints. Validated when built."""

    #: a local directory or ``az://container/path``
    uri: str
    #: save every ``interval`` steps in :meth:`Checkpointer.maybe_save` (0: only explicit saves)
    interval: int = 0
    #: keep the newest N committed checkpoints (>= 1)
    keep_last: int = 3
    #: also keep every checkpoint whose step is a multiple of K, forever (0: none)
    keep_every: int = 0
    #: periodic saves copy and write in the Checkpointer's thread; the step blocks only to take the state
    #: dicts and copy the buffers (see ``overlap_staging``)
    async_save: bool = True
    #: async saves copy parameters and optimizer state in the background while the next forward and
    #: backward run; the optimizer's next ``step()`` waits until the copy is done (a step pre-hook). Turn
    #: off when the loop changes parameters in place outside ``optimizer.step()`` (or call
    #: :meth:`Checkpointer.wait_staged` before it does)
    overlap_staging: bool = True
    #: writer threads per rank (files per rank); 2 doubles DCP's write bandwidth here
    thread_count: int = 2
    #: what a failed save does: "continue" logs it loudly and trains on (the previous checkpoint stays
    #: the one to resume from) until ``max_failed_saves`` in a row; "stop" raises CheckpointError
    on_save_error: Literal["continue", "stop"] = "continue"
    max_failed_saves: int = 3
    #: the model's config, written into every manifest so a resume can rebuild from files alone
    model_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = "CheckpointConfig"
        for name, low in (("interval", 0), ("keep_last", 1), ("keep_every", 0), ("thread_count", 1),
                          ("max_failed_saves", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise CheckpointError(f"{name}={value!r} must be an integer >= {low}", where=f"{where}.{name}",
                                      fix=f"e.g. {name}={max(low, 1)}")
        if self.on_save_error not in ("continue", "stop"):
            raise CheckpointError(f"on_save_error={self.on_save_error!r} is not one of 'continue', 'stop'",
                                  where=f"{where}.on_save_error", fix="on_save_error='continue'")
        try:
            json.dumps(dict(self.model_config))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"model_config is not JSON-serialisable: {e}", where=f"{where}.model_config",
                                  fix="pass plain numbers, strings, lists and dicts") from None


# --- the save path -------------------------------------------------------------------------------------
class _CachedStager:
    """Copies the state into CPU buffers allocated once and reused by every async save.

    Tensors whose storage only an optimizer's ``step()`` changes (``deferrable``: parameters and
    optimizer state of optimizers that wait for staging in a step pre-hook) are copied by the save thread
    while training goes on to the next forward and backward, which only read them; the rest (buffers,
    which forward may change, and anything else) is copied before ``stage`` returns. ``stage`` returns
    the rest of the copy, for the save thread to run; ``copying`` is set once it is done. This is
    CheckFreq's pipelined snapshot
    (Mohan et al., FAST '21), and DCP's own ``StagingOptions(use_async_staging=True)`` minus the part
    that needs CUDA.

    DCP's own stager caches its buffers only in pinned memory, which a CPU-only torch cannot allocate;
    re-allocating ~GBs per save would cost far more than a memcpy. Safe because the Checkpointer never
    starts a save before the previous one finished writing.

    Replicated state (DDP: every rank holds all of it) is written once, each tensor by one rank, as DCP's
    deterministic de-duplication decides. So from the second save of the same state on, a rank copies only
    the tensors it wrote last time (``owned``) and hands the others to DCP as they are: with N ranks the
    step blocks for 1/N of the copy. The writer checks the plan against what was copied: a save that would
    write a tensor not copied fails (nothing is committed) rather than write one that training moves, and
    the next save copies everything again.
    """

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}
        self._keys: Any = None
        #: tensors (flat DCP names) this rank wrote in the last committed save of this structure
        self.owned: frozenset[str] | None = None
        #: tensors the last stage() copied; None: all of them
        self.copied: frozenset[str] | None = None
        #: storages (data_ptr) that only a waiting optimizer's step() changes; set before each save
        self.deferrable: frozenset[int] = frozenset()
        #: tensors the last stage() left to the background copy
        self.deferred: frozenset[str] = frozenset()
        #: set when the last stage()'s deferred copy is done (or failed); None: nothing was deferred
        self.copying: threading.Event | None = None

    def stage(self, state_dict: dict[str, Any]) -> Callable[[], dict[str, Any]]:
        flat, mapping = flatten_state_dict(state_dict)
        keys = _structure(flat)
        if keys != self._keys:
            self._cache, self._keys, self.owned = {}, keys, None
        owned = self.owned
        chosen = {k: v for k, v in flat.items() if owned is None or k in owned or not isinstance(v, torch.Tensor)}
        later = {k: v for k, v in chosen.items() if isinstance(v, torch.Tensor) and _storage_ptr(v) in self.deferrable}
        staged = {**flat, **self._copy({k: v for k, v in chosen.items() if k not in later})}
        self.copied = None if owned is None else frozenset(k for k in chosen if isinstance(flat[k], torch.Tensor))
        self.deferred = frozenset(later)
        copying = self.copying = threading.Event() if later else None

        def finish() -> dict[str, Any]:
            if copying is not None:
                try:
                    staged.update(self._copy(later))
                finally:
                    copying.set()
            return unflatten_state_dict(staged, mapping)

        return finish

    def _copy(self, part: dict[str, Any]) -> dict[str, Any]:
        # buffers are made on first use, for every tensor eventually: the owned set may change
        missing = {k: v for k, v in part.items() if k not in self._cache}
        if missing:
            self._cache.update(_create_cpu_state_dict(missing))
        return _copy_state_dict(part, {k: self._cache[k] for k in part}, type_check=False)

    def close(self) -> None:
        self._cache, self._keys, self.copying = {}, None, None


def _wait_staged_hook(checkpointer: Checkpointer) -> Callable[..., None]:
    """An optimizer step pre-hook that waits for the Checkpointer's background copy. It holds the
    Checkpointer weakly: an optimizer must not keep it (and its process group) alive until interpreter
    shutdown, where destroying a gloo group aborts the process."""
    ref = weakref.ref(checkpointer)

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        ck = ref()
        if ck is not None:
            ck.wait_staged()

    return hook


def _commit_before_exit(checkpointer: Checkpointer) -> None:
    """A script that ends without ``close()`` still gets its last async save committed: wait for it when
    the main thread ends, before the interpreter joins threads and refuses new thread pools (which the
    commit uses). ``threading._register_atexit`` is how concurrent.futures itself gets that slot; an
    ``atexit`` handler would run too late."""
    ref = weakref.ref(checkpointer)

    def drain() -> None:
        ck = ref()
        if ck is not None and ck._pending is not None:
            log.info("waiting for the checkpoint of step %d to commit before exiting", ck._pending[1])
            try:
                ck.wait()
            except Exception as e:  # noqa: BLE001 - the failure is logged; exiting goes on
                log.error("%s", e)

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(drain)


def _updates_in_step(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of torch.optim's, which change parameters and state only in step()."""
    return isinstance(optimizer, torch.optim.Optimizer) and type(optimizer).__module__.startswith("torch.optim.")


def _storage_ptr(t: Any) -> int | None:
    """The address of the memory a tensor (a DTensor: its local shard) lives in; None when unknown."""
    try:
        local = t.to_local() if hasattr(t, "to_local") else t
        return int(local.untyped_storage().data_ptr())
    except Exception:  # noqa: BLE001 - a tensor subclass without storage: copied before stage() returns
        return None


def _structure(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return tuple((k, _structure(v)) for k, v in obj.items())
    if hasattr(obj, "shape"):
        return (tuple(obj.shape), str(obj.dtype))
    return type(obj).__name__


@dataclass
class _SaveJob:
    storage: CheckpointStorage
    step: int
    rank: int
    world_size: int
    local_dir: Path
    threads: int
    extra: dict[str, Any]
    hook: PhaseHook | None
    keep_last: int
    keep_every: int

    @property
    def rel(self) -> str:
        return step_dir(self.step)

    def after_write(self, results: list[Any], hashed: Mapping[str, dict[str, Any]]) -> None:
        """On every rank, after DCP wrote its shards locally: hashes, upload (Blob), the sidecar."""
        with _plain_errors(f"rank {self.rank}"):
            self._after_write(results, hashed)

    def _after_write(self, results: list[Any], hashed: Mapping[str, dict[str, Any]]) -> None:
        names = sorted({r.storage_data.relative_path for r in results})
        # hashed while written; a file whose size disagrees (written some other way) is read back
        digests = {n: hashed[n] for n in names if n in hashed and hashed[n]["bytes"] == (self.local_dir / n).stat().st_size}
        digests.update(_hash_files({n: self.local_dir / n for n in names if n not in digests}, self.threads))
        if self.hook:
            self.hook("shards_written", self.step)
        if self.storage.remote:
            for n in names:
                self.storage.upload(self.local_dir / n, f"{self.rel}/{n}")
        sidecar = f"hashes-rank{self.rank:05d}.json"
        payload = json.dumps(digests, sort_keys=True).encode()
        if self.storage.remote:
            self.storage.fs.pipe_file(self.storage.path(f"{self.rel}/{sidecar}"), payload)
            for n in names:
                (self.local_dir / n).unlink(missing_ok=True)
        else:
            _write_synced(self.local_dir / sidecar, payload)

    def commit(self) -> None:
        """On rank 0, after DCP wrote .metadata: gather the sidecars and commit the manifest, last."""
        with _plain_errors("commit"):
            self._commit()

    def _commit(self) -> None:
        meta = self.local_dir / ".metadata"
        files = _hash_files({".metadata": meta}, 1)
        if self.storage.remote:
            self.storage.upload(meta, f"{self.rel}/.metadata")
        for r in range(self.world_size):
            sidecar = f"hashes-rank{r:05d}.json"
            try:
                raw = self.storage.read_bytes(f"{self.rel}/{sidecar}")
            except FileNotFoundError:
                raise CheckpointError(f"rank {r} wrote no {sidecar}", where=self.storage.display(self.rel)) from None
            files.update(json.loads(raw))
            files[sidecar] = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
        manifest = {
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "files": files,
            **self.extra,
        }
        if self.hook:
            self.hook("before_manifest", self.step)
        self.storage.write_exclusive(f"{self.rel}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())
        if self.storage.remote:
            shutil.rmtree(self.local_dir, ignore_errors=True)
        # here, not on the training thread: deleting GBs takes rank 0 long enough to stall every rank
        try:
            _retain(self.storage, newest=self.step, keep_last=self.keep_last, keep_every=self.keep_every)
        except Exception as e:  # noqa: BLE001 - retention failing must not fail the save or stop training
            log.warning("could not delete old checkpoints under %s: %s", self.storage.uri, e)


def _retain(storage: CheckpointStorage, *, newest: int, keep_last: int, keep_every: int) -> None:
    """Delete committed checkpoints beyond ``keep_last`` (except multiples of ``keep_every``) and
    interrupted saves older than ``newest``."""
    committed, partial = [], []
    for step, rel in scan_steps(storage):
        (committed if read_manifest(storage, rel, step) is not None else partial).append(step)
    keep = set(committed[-keep_last:]) | {newest}
    if keep_every:
        keep |= {s for s in committed if s % keep_every == 0}
    doomed = [s for s in committed if s not in keep] + [s for s in partial if s < newest]
    for step in doomed:
        rel = step_dir(step)
        # un-commit first: a half-deleted directory must never look like a checkpoint
        storage.remove_file(f"{rel}/{MANIFEST}")
        storage.remove_tree(rel)
        log.info("deleted old checkpoint %s", storage.display(rel))


@contextlib.contextmanager
def _plain_errors(who: str) -> Iterator[None]:
    """DCP pickles a rank's exception to send it to the others; SDK exceptions (aiohttp, azure) carry
    tracebacks and fail to pickle, which would hide the real cause. Send a plain one instead."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        text = str(e).strip().splitlines()
        raise CheckpointError(f"{who}: {type(e).__name__}: {text[0][:300] if text else ''}") from None


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class _HashingFile:
    """A file being written that hashes every byte on its way in: a shard is hashed once, as DCP writes
    it, instead of read back afterwards. DCP writes shard files front to back (``write``/``tell`` only);
    anything else is refused rather than allowed to make the hash wrong."""

    def __init__(self, f: Any) -> None:
        self._f, self._h, self.nbytes = f, hashlib.sha256(), 0

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self._f.write(view)
        self._h.update(view)  # releases the GIL on large buffers
        self.nbytes += view.nbytes
        return view.nbytes

    def digest(self) -> dict[str, Any]:
        return {"sha256": self._h.hexdigest(), "bytes": self.nbytes}

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


class _HashingFileSystem(FileSystem):
    """DCP's local file system, with shard files hashed as they are written (``digests`` by file name)."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        # torch.save's zip records carry a CRC32 of every tensor: a second checksum pass, as costly as the
        # sha256 here (~100 ms per 150 MB), that nothing reads (torch.load does not check it; resume checks
        # the sha256). The setting is thread-local: this writer thread only.
        prior = serialization_config.save.compute_crc32
        serialization_config.save.compute_crc32 = False
        try:
            with super().create_stream(path, mode) as stream:
                hashing = _HashingFile(stream)
                yield hashing
        finally:
            serialization_config.save.compute_crc32 = prior
        self.digests[Path(path).name] = hashing.digest()  # one writer thread per file: no lock needed


class _CommitWriter(FileSystemWriter):
    """DCP's FileSystemWriter plus azulite's commit protocol (see the module docstring)."""

    def __init__(self, job: _SaveJob, stager: _CachedStager | None = None) -> None:
        super().__init__(job.local_dir, single_file_per_rank=True, sync_files=True,
                         thread_count=job.threads, overwrite=True)
        self.job = job
        self.fs = _HashingFileSystem()
        self.stager = stager  # an async save's: what it copied
        self.written: frozenset[str] | None = None  # the tensors this rank's plan wrote

    def write_data(self, plan: Any, planner: Any) -> TorchFuture:
        tensors = {i.index.fqn for i in plan.items if i.type != WriteItemType.BYTE_IO}
        copied = self.stager.copied if self.stager is not None else None
        if copied is not None and not tensors <= copied:
            moving = sorted(tensors - copied)
            raise CheckpointError(f"rank {self.job.rank}: the save plan writes {len(moving)} tensor(s) this rank did "
                                  f"not copy (e.g. {moving[0]}); the next save copies everything")
        self.written = frozenset(tensors)
        results = super().write_data(plan, planner).wait()
        self.job.after_write(results, self.fs.digests)
        fut: TorchFuture = TorchFuture()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        self.job.commit()


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
        base = settings.staging_dir or os.path.join(tempfile.gettempdir(), "azulite-staging")
        self._staging = Path(base) / hashlib.sha1(self.storage.uri.encode()).hexdigest()[:12]
        self._stager = _CachedStager()
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
                if _updates_in_step(opt) and opt not in self._waiting_optimizers:
                    self._waiting_optimizers.append(opt)
                    self._hooks.append(opt.register_step_pre_hook(_wait_staged_hook(self)))
        _commit_before_exit(self)
        self._failed_in_a_row = 0
        self.last_committed: int | None = None
        #: the manifest of the checkpoint that :meth:`load_latest` restored (None before / when fresh)
        self.loaded_manifest: dict[str, Any] | None = None
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

    def _check_storage(self) -> None:
        # rank 0 first (it may create the container), then everyone: each node must reach the storage
        err = None
        if self.ctx.is_main:
            err = _probe(self.storage)
        err = self._broadcast(err)
        if err is None and not self.ctx.is_main:
            err = _probe(self.storage)
        errors = [e for e in self._gather(err) if e]
        if errors:
            raise StorageError(errors[0][0], where=self.storage.uri, fix=errors[0][1])

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
                dcp.save(self.state, storage_writer=self._writer(step, None), process_group=self._pg,
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

        def write() -> _CommitWriter | None:
            state_dict, failed = None, None
            try:
                state_dict = finish_copy()
            except Exception as e:  # noqa: BLE001 - told to every rank below, so none waits alone
                failed = f"rank {self.ctx.rank}: copying the state failed: {type(e).__name__}: {e}"
            if self._already_committed(step, failed):
                return None
            writer = self._writer(step, self._stager)
            dcp.save(state_dict, storage_writer=writer, process_group=self._pg, no_dist=self._pg is None)
            return writer

        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="azulite-ckpt")
        self._pending = (self._thread.submit(write), step, t0)
        return True

    def _already_committed(self, step: int, failed: str | None = None) -> bool:
        """Before DCP starts, on every rank: is ``step`` committed already (then nothing is saved), and can
        every rank reach the storage (and did it stage the state: ``failed`` says why not)? Decided
        together, so no rank waits in a collective the others skipped; a leftover of an interrupted save
        of the same step is removed."""
        rel = step_dir(step)
        committed, err = False, failed
        try:
            committed = failed is None and read_manifest(self.storage, rel, step) is not None
            if failed is None and not committed and self.ctx.is_main and self.storage.exists(rel):
                log.warning("removing %s: an interrupted save of the same step", self.storage.display(rel))
                self.storage.remove_tree(rel)
        except Exception as e:  # noqa: BLE001 - any storage failure
            err = f"rank {self.ctx.rank}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        verdicts = self._gather((committed, err))
        errors = [e for _, e in verdicts if e]
        if errors:
            raise CheckpointError(errors[0])
        if verdicts[0][0]:
            log.info("checkpoint step %d is already committed; not saving it again", step)
            return True
        return False

    def _writer(self, step: int, stager: _CachedStager | None) -> _CommitWriter:
        rel = step_dir(step)
        local = Path(self.storage.path(rel)) if not self.storage.remote else self._staging / rel / f"rank-{self.ctx.rank}"
        local.mkdir(parents=True, exist_ok=True)
        job = _SaveJob(storage=self.storage, step=step, rank=self.ctx.rank, world_size=self.ctx.world_size,
                       local_dir=local, threads=self.config.thread_count, extra=self._manifest_extra(),
                       hook=self.phase_hook, keep_last=self.config.keep_last, keep_every=self.config.keep_every)
        return _CommitWriter(job, stager)

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
            ptrs.update(_storage_ptr(p) for group in opt.param_groups for p in group["params"])
            ptrs.update(_storage_ptr(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
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

    def _failed(self, step: int, exc: BaseException, raise_on_error: bool | None) -> bool:
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
        choice: tuple[int, dict[str, Any]] | str | None = None
        if self.ctx.is_main:
            try:
                choice = self._choose()
            except Exception as e:  # noqa: BLE001 - every rank must raise the same thing
                choice = f"{type(e).__name__}: {e}"
        choice = self._broadcast(choice)
        if isinstance(choice, str):
            raise CheckpointError(choice, where=self.storage.uri,
                                  fix="inspect the checkpoints; delete the directory to start from scratch")
        if choice is None:
            log.info("no committed checkpoint under %s: starting from scratch", self.storage.uri)
            return None
        step, manifest = choice
        # rank 0 verified (and, for Blob, downloaded) it while choosing; on Blob the others download and
        # verify their own copy; local files rank 0 verified are the very files the others read
        if self.ctx.is_main or not self.storage.remote:
            path = self._restore_dir(step)
        else:
            path = self._local_copy(step, manifest, verify=True)
        state = dict(self.state)
        saved_ws = int(manifest["world_size"])
        for name, obj in self.state.items():
            key = getattr(obj, "key", None)
            if key is not None and key.startswith("rank") and self.ctx.rank >= saved_ws:
                log.info("no saved %r for rank %d (checkpoint of world size %d): keeping the seeded one",
                         name, self.ctx.rank, saved_ws)
                state.pop(name)
        dcp.load(state, storage_reader=FileSystemReader(path), process_group=self._pg, no_dist=self._pg is None)
        if self.storage.remote:
            shutil.rmtree(self._restore_dir(step), ignore_errors=True)  # this rank's copy only
        self.loaded_manifest = manifest
        self.last_committed = step
        if saved_ws != self.ctx.world_size:
            log.info("checkpoint step %d was saved by %d ranks, loaded on %d", step, saved_ws, self.ctx.world_size)
        log.info("resumed from checkpoint step %d (%s)", step, self.storage.display(step_dir(step)))
        return step

    def _choose(self) -> tuple[int, dict[str, Any]] | None:
        corrupt = 0
        for step, rel in reversed(scan_steps(self.storage)):
            manifest = read_manifest(self.storage, rel, step)
            if manifest is None:
                if self.storage.exists(f"{rel}/manifest.corrupt.json"):
                    log.warning("ignoring %s: found corrupt earlier", self.storage.display(rel))
                    corrupt += 1
                else:
                    log.warning("ignoring %s: no valid %s (an interrupted save)", self.storage.display(rel), MANIFEST)
                continue
            try:
                self._local_copy(step, manifest, verify=True)
            except CheckpointError as e:
                if self.storage.remote:
                    shutil.rmtree(self._restore_dir(step), ignore_errors=True)
                log.warning("checkpoint step %d is corrupt: %s; falling back to the previous one", step, e.message)
                self._quarantine(rel)
                corrupt += 1
                continue
            return step, manifest
        if corrupt:
            raise CheckpointError(f"none of the {corrupt} committed checkpoint(s) under {self.storage.uri} is intact")
        return None

    def _quarantine(self, rel: str) -> None:
        """Un-commit a corrupt checkpoint (manifest.json -> manifest.corrupt.json): it stops counting, the
        evidence stays, and a later save of the same step replaces it."""
        try:
            self.storage.fs.mv(self.storage.path(f"{rel}/{MANIFEST}"), self.storage.path(f"{rel}/manifest.corrupt.json"))
            log.warning("un-committed %s (manifest renamed to manifest.corrupt.json)", self.storage.display(rel))
        except Exception as e:  # noqa: BLE001 - read-only storage: resume still skips it every time
            log.warning("could not un-commit corrupt checkpoint %s: %s", self.storage.display(rel), e)

    def _restore_dir(self, step: int) -> Path:
        if self.storage.remote:
            return self._staging / f"restore-{step_dir(step)}" / f"rank-{self.ctx.rank}"
        return Path(self.storage.path(step_dir(step)))

    def _local_copy(self, step: int, manifest: dict[str, Any], *, verify: bool) -> Path:
        """The checkpoint as a local directory (downloaded for Blob), its files checked against the manifest."""
        rel = step_dir(step)
        files: dict[str, Any] = manifest["files"]
        local = self._restore_dir(step)
        if self.storage.remote:
            for name in files:
                try:
                    self.storage.download(f"{rel}/{name}", local / name)
                except FileNotFoundError:
                    raise CheckpointError(f"file {name} is missing", where=self.storage.display(rel)) from None
        if verify:
            missing = [n for n in files if not (local / n).is_file()]
            if missing:
                raise CheckpointError(f"file {missing[0]} is missing", where=self.storage.display(rel))
            actual = _hash_files({n: local / n for n in files}, self.config.thread_count)
            for name, want in files.items():
                got = actual[name]
                if got["sha256"] != want["sha256"] or got["bytes"] != want["bytes"]:
                    raise CheckpointError(
                        f"file {name} does not match the manifest (sha256 {got['sha256'][:12]}.. "
                        f"{got['bytes']} B, expected {want['sha256'][:12]}.. {want['bytes']} B)",
                        where=self.storage.display(rel),
                    )
        return local


def _probe(storage: CheckpointStorage) -> tuple[str, str] | None:
    try:
        storage.check()
    except StorageError as e:
        return (e.message, e.fix or "")
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
