"""Restore: find the newest checkpoint whose files match their manifest, and give its files to DCP.

A committed checkpoint is trusted only after every file's sha256 matches the manifest; a corrupt one is
un-committed (``manifest.corrupt.json``) and the previous one is used. Blob checkpoints are downloaded
into a per-rank local directory first (hashing a blob means reading it anyway). The collectives that make
every rank load the same step are the Checkpointer's; this module touches only storage.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem

from azulite.errors import CheckpointError
from azulite.train.catalog import MANIFEST, read_manifest, scan_steps, step_dir
from azulite.train.commit import hash_files
from azulite.train.storage import CheckpointStorage

log = logging.getLogger("azulite.train.checkpoint")


class IntegrityError(CheckpointError):
    """A checkpoint file that is missing or does not match its manifest: the checkpoint is corrupt."""


def _mismatch(name: str, got_sha: str, got_bytes: int, want: Mapping[str, Any], where: str) -> IntegrityError:
    return IntegrityError(f"file {name} does not match the manifest (sha256 {got_sha[:12]}.. {got_bytes} B, "
                          f"expected {want['sha256'][:12]}.. {want['bytes']} B) [{where}]")


class _VerifiedFiles(FileSystem):
    """DCP's local file system for reading, where a file's bytes reach DCP only after its sha256 and size
    matched the manifest. Each file is read whole, once, and hashed in the same pass (no separate read-back
    for the check); the files this rank's load plan needs are read and hashed ahead in ``threads`` threads
    while DCP deserialises the ones before (hashlib and file reads release the GIL). Costs this rank's
    share of the checkpoint in memory at most, each file freed once DCP has read it."""

    def __init__(self, files: Mapping[str, Any], threads: int, where: str) -> None:
        super().__init__()
        self._files, self._where = files, where
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="azulite-verify")
        self._ahead: dict[str, Future] = {}

    def prefetch(self, paths: list[Path]) -> None:
        for p in paths:
            if p.name not in self._ahead:
                self._ahead[p.name] = self._pool.submit(self._read, p)

    def _read(self, path: Path) -> bytes:
        want = self._files.get(path.name)
        if want is None:
            raise IntegrityError(f"file {path.name} is not in the manifest [{self._where}]")
        try:
            with open(path, "rb", buffering=0) as f:
                data = f.read()
        except FileNotFoundError:
            raise IntegrityError(f"file {path.name} is missing [{self._where}]") from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != want["sha256"] or len(data) != want["bytes"]:
            raise _mismatch(path.name, digest, len(data), want, self._where)
        return data

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if mode != "rb":
            raise IntegrityError(f"a checkpoint is read-only while it is restored (mode {mode!r})")
        p = Path(path)
        fut = self._ahead.pop(p.name, None)
        data = fut.result() if fut is not None else self._read(p)
        yield io.BytesIO(data)

    def close(self) -> None:
        for fut in self._ahead.values():
            fut.cancel()
        self._ahead.clear()
        self._pool.shutdown(wait=True)


class VerifyingReader(FileSystemReader):
    """DCP's FileSystemReader over :class:`_VerifiedFiles`: every byte DCP reads (``.metadata`` and the
    shards) is checked against the manifest first."""

    def __init__(self, path: Path, manifest: Mapping[str, Any], threads: int, where: str) -> None:
        super().__init__(path)
        self.fs = _VerifiedFiles(manifest["files"], threads, where)

    def read_data(self, plan: Any, planner: Any) -> Any:
        names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        self.fs.prefetch([Path(self.fs.concat_path(self.path, n)) for n in names])
        try:
            return super().read_data(plan, planner)
        finally:
            self.fs.close()


class Restorer:
    """Reads one rank's view of a checkpoint location: ``staging`` holds Blob downloads, ``threads`` hash
    files in parallel."""

    def __init__(self, storage: CheckpointStorage, *, rank: int, staging: Path, threads: int) -> None:
        self.storage = storage
        self.rank = rank
        self.staging = staging
        self.threads = threads

    def choose(self, *, verify: bool = True) -> tuple[int, dict[str, Any]] | None:
        """The newest intact checkpoint (step, manifest); None when there is none. Raises CheckpointError
        when there are committed checkpoints and none of them is intact. Without ``verify`` (local
        checkpoints read through :class:`VerifyingReader`, which checks every byte as it is read) only
        that every file is there with its size is checked here."""
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
                if verify or self.storage.remote:
                    self.local_copy(step, manifest, verify=True)
                else:
                    self.check_sizes(step, manifest)
            except CheckpointError as e:
                self.discard(step)
                log.warning("checkpoint step %d is corrupt: %s; falling back to the previous one", step, e.message)
                self.quarantine(rel)
                corrupt += 1
                continue
            return step, manifest
        if corrupt:
            raise CheckpointError(f"none of the {corrupt} committed checkpoint(s) under {self.storage.uri} is intact")
        return None

    def quarantine(self, rel: str) -> None:
        """Un-commit a corrupt checkpoint (manifest.json -> manifest.corrupt.json): it stops counting, the
        evidence stays, and a later save of the same step replaces it."""
        try:
            self.storage.fs.mv(self.storage.path(f"{rel}/{MANIFEST}"), self.storage.path(f"{rel}/manifest.corrupt.json"))
            log.warning("un-committed %s (manifest renamed to manifest.corrupt.json)", self.storage.display(rel))
        except Exception as e:  # noqa: BLE001 - read-only storage: resume still skips it every time
            log.warning("could not un-commit corrupt checkpoint %s: %s", self.storage.display(rel), e)

    def check_sizes(self, step: int, manifest: dict[str, Any]) -> None:
        """Every file of a local checkpoint is there with the manifest's size (a stat, no read)."""
        local = self.restore_dir(step)
        for name, want in manifest["files"].items():
            try:
                size = (local / name).stat().st_size
            except FileNotFoundError:
                raise IntegrityError(f"file {name} is missing", where=self.storage.display(step_dir(step))) from None
            if size != want["bytes"]:
                raise IntegrityError(f"file {name} is {size} B, the manifest says {want['bytes']} B",
                                     where=self.storage.display(step_dir(step)))

    def restore_dir(self, step: int) -> Path:
        """Where DCP reads checkpoint ``step`` from on this rank."""
        if self.storage.remote:
            return self.staging / f"restore-{step_dir(step)}" / f"rank-{self.rank}"
        return Path(self.storage.path(step_dir(step)))

    def discard(self, step: int) -> None:
        """Drop this rank's downloaded copy (Blob); local checkpoints are read in place and kept."""
        if self.storage.remote:
            shutil.rmtree(self.restore_dir(step), ignore_errors=True)

    def local_copy(self, step: int, manifest: dict[str, Any], *, verify: bool) -> Path:
        """The checkpoint as a local directory (downloaded for Blob), its files checked against the manifest."""
        rel = step_dir(step)
        files: dict[str, Any] = manifest["files"]
        local = self.restore_dir(step)
        if self.storage.remote:
            for name in files:
                try:
                    self.storage.download(f"{rel}/{name}", local / name)
                except FileNotFoundError:
                    raise IntegrityError(f"file {name} is missing", where=self.storage.display(rel)) from None
        if verify:
            missing = [n for n in files if not (local / n).is_file()]
            if missing:
                raise IntegrityError(f"file {missing[0]} is missing", where=self.storage.display(rel))
            actual = hash_files({n: local / n for n in files}, self.threads)
            for name, want in files.items():
                got = actual[name]
                if got["sha256"] != want["sha256"] or got["bytes"] != want["bytes"]:
                    raise _mismatch(name, got["sha256"], got["bytes"], want, self.storage.display(rel))
        return local
