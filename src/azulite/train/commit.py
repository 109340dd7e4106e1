"""The commit protocol: how a save becomes a checkpoint, or nothing.

Every rank writes its DCP shards (hashed as they are written, ``HashingFileSystem``), uploads them when
the storage is Blob, and leaves a ``hashes-rankNNNNN.json`` sidecar; then the coordinator gathers the
sidecars into ``manifest.json``, written last and exclusively (``If-None-Match: *`` on Blob): a step
directory without a valid manifest is an interrupted save and does not exist as a checkpoint. Both halves
run inside DCP's own protocol (``CommitWriter.write_data`` on every rank, ``finish`` on the coordinator),
so a failure on any rank fails the save everywhere. Retention runs here too, after the commit, off the
training thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import WriteItemType
from torch.futures import Future as TorchFuture
from torch.utils.serialization import config as serialization_config

from azulite.errors import CheckpointError
from azulite.train import digest
from azulite.train.catalog import MANIFEST, MANIFEST_FORMAT, read_manifest, scan_steps, step_dir
from azulite.train.staging import CachedStager
from azulite.train.storage import CheckpointStorage, remove_if_empty

log = logging.getLogger("azulite.train.checkpoint")

#: Called with (phase, step) at the points where a failure matters: "save_start" on every rank before a
#: save touches storage, "shards_written" on every rank after its local shards are on disk (before
#: upload), "before_manifest" on rank 0 before the commit. A seam for
#: fault-injection tests and telemetry.
PhaseHook = Callable[[str, int], None]


def hash_files(paths: Mapping[str, Path], threads: int) -> dict[str, dict[str, Any]]:
    """Manifest entries (digest and size) of these files, ``threads`` at a time."""
    def one(name: str) -> tuple[str, dict[str, Any]]:
        return name, digest.file_entry(paths[name])

    if threads <= 1 or len(paths) <= 1:
        return dict(map(one, sorted(paths)))
    with ThreadPoolExecutor(max_workers=min(threads, len(paths))) as pool:
        return dict(pool.map(one, sorted(paths)))


@dataclass
class SaveJob:
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
    #: time.perf_counter() when save() was called (rank 0's is the one recorded)
    started: float

    @property
    def rel(self) -> str:
        return step_dir(self.step)

    def after_write(self, results: list[Any], hashed: Mapping[str, dict[str, Any]]) -> None:
        """On every rank, after DCP wrote its shards locally: hashes, upload (Blob), the sidecar."""
        with plain_errors(f"rank {self.rank}"):
            self._after_write(results, hashed)

    def _after_write(self, results: list[Any], hashed: Mapping[str, dict[str, Any]]) -> None:
        names = sorted({r.storage_data.relative_path for r in results})
        # hashed while written; a file whose size disagrees (written some other way) is read back
        digests = {n: hashed[n] for n in names if n in hashed and hashed[n]["bytes"] == (self.local_dir / n).stat().st_size}
        digests.update(hash_files({n: self.local_dir / n for n in names if n not in digests}, self.threads))
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
            if self.rank != 0:  # done with its staging folder (rank 0 writes .metadata there next, in commit)
                shutil.rmtree(self.local_dir, ignore_errors=True)
                remove_if_empty(self.local_dir.parent)
        else:
            write_synced(self.local_dir / sidecar, payload)

    def commit(self) -> None:
        """On rank 0, after DCP wrote .metadata: gather the sidecars and commit the manifest, last."""
        with plain_errors("commit"):
            self._commit()

    def _commit(self) -> None:
        meta = self.local_dir / ".metadata"
        files = hash_files({".metadata": meta}, 1)
        if self.storage.remote:
            self.storage.upload(meta, f"{self.rel}/.metadata")
        for r in range(self.world_size):
            sidecar = f"hashes-rank{r:05d}.json"
            try:
                raw = self.storage.read_bytes(f"{self.rel}/{sidecar}")
            except FileNotFoundError:
                raise CheckpointError(f"rank {r} wrote no {sidecar}", where=self.storage.display(self.rel)) from None
            files.update(json.loads(raw))
            h = digest.new()
            h.update(raw)
            files[sidecar] = digest.entry(h.hexdigest(), len(raw))
        manifest = {
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "files": files,
            # from save() to the manifest (an async save: copy + write + commit, while training runs on);
            # the checkpoint-interval planner reads it as the cost of one checkpoint
            "save_seconds": round(time.perf_counter() - self.started, 4),
            **self.extra,
        }
        if self.hook:
            self.hook("before_manifest", self.step)
        self.storage.write_exclusive(f"{self.rel}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())
        if self.storage.remote:  # its staging folder, and the step's once no rank on this host uses it
            shutil.rmtree(self.local_dir, ignore_errors=True)
            remove_if_empty(self.local_dir.parent)
        # here, not on the training thread: deleting GBs takes rank 0 long enough to stall every rank
        try:
            retain(self.storage, newest=self.step, keep_last=self.keep_last, keep_every=self.keep_every)
        except Exception as e:  # noqa: BLE001 - retention failing must not fail the save or stop training
            log.warning("could not delete old checkpoints under %s: %s", self.storage.uri, e)


def retain(storage: CheckpointStorage, *, newest: int, keep_last: int, keep_every: int) -> None:
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
def plain_errors(who: str) -> Iterator[None]:
    """DCP pickles a rank's exception to send it to the others; SDK exceptions (aiohttp, azure) carry
    tracebacks and fail to pickle, which would hide the real cause. Send a plain one instead."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        text = str(e).strip().splitlines()
        raise CheckpointError(f"{who}: {type(e).__name__}: {text[0][:300] if text else ''}") from None


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class HashingFile:
    """A file being written that hashes every byte on its way in: a shard is hashed once, as DCP writes
    it, instead of read back afterwards. DCP writes shard files front to back (``write``/``tell`` only);
    anything else is refused rather than allowed to make the hash wrong."""

    def __init__(self, f: Any) -> None:
        self._f, self._h, self.nbytes = f, digest.new(), 0

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self._f.write(view)
        self._h.update(view)  # releases the GIL on large buffers
        self.nbytes += view.nbytes
        return view.nbytes

    def entry(self) -> dict[str, Any]:
        return digest.entry(self._h.hexdigest(), self.nbytes)

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


class HashingFileSystem(FileSystem):
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
        # torch.save's zip records carry a CRC32 of every tensor: a second checksum pass (~100 ms per 150 MB
        # here) that nothing reads (torch.load does not check it; resume checks the manifest's digest). The
        # setting is thread-local: this writer thread only.
        prior = serialization_config.save.compute_crc32
        serialization_config.save.compute_crc32 = False
        try:
            with super().create_stream(path, mode) as stream:
                hashing = HashingFile(stream)
                yield hashing
        finally:
            serialization_config.save.compute_crc32 = prior
        self.digests[Path(path).name] = hashing.entry()  # one writer thread per file: no lock needed


class CommitWriter(FileSystemWriter):
    """DCP's FileSystemWriter plus azulite's commit protocol (see the module docstring)."""

    def __init__(self, job: SaveJob, stager: CachedStager | None = None) -> None:
        super().__init__(job.local_dir, single_file_per_rank=True, sync_files=True,
                         thread_count=job.threads, overwrite=True)
        self.job = job
        self.fs = HashingFileSystem()
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
