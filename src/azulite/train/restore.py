"""Restore: find the newest checkpoint whose files match their manifest, and give its files to DCP.

A committed checkpoint is trusted only after every file's sha256 matches the manifest; a corrupt one is
un-committed (``manifest.corrupt.json``) and the previous one is used. Blob checkpoints are downloaded
into a per-rank local directory first (hashing a blob means reading it anyway). The collectives that make
every rank load the same step are the Checkpointer's; this module touches only storage.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from azulite.errors import CheckpointError
from azulite.train.catalog import MANIFEST, read_manifest, scan_steps, step_dir
from azulite.train.commit import hash_files
from azulite.train.storage import CheckpointStorage

log = logging.getLogger("azulite.train.checkpoint")


class Restorer:
    """Reads one rank's view of a checkpoint location: ``staging`` holds Blob downloads, ``threads`` hash
    files in parallel."""

    def __init__(self, storage: CheckpointStorage, *, rank: int, staging: Path, threads: int) -> None:
        self.storage = storage
        self.rank = rank
        self.staging = staging
        self.threads = threads

    def choose(self) -> tuple[int, dict[str, Any]] | None:
        """The newest intact checkpoint (step, manifest), verified; None when there is none. Raises
        CheckpointError when there are committed checkpoints and none of them is intact."""
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
                self.local_copy(step, manifest, verify=True)
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
                    raise CheckpointError(f"file {name} is missing", where=self.storage.display(rel)) from None
        if verify:
            missing = [n for n in files if not (local / n).is_file()]
            if missing:
                raise CheckpointError(f"file {missing[0]} is missing", where=self.storage.display(rel))
            actual = hash_files({n: local / n for n in files}, self.threads)
            for name, want in files.items():
                got = actual[name]
                if got["sha256"] != want["sha256"] or got["bytes"] != want["bytes"]:
                    raise CheckpointError(
                        f"file {name} does not match the manifest (sha256 {got['sha256'][:12]}.. "
                        f"{got['bytes']} B, expected {want['sha256'][:12]}.. {want['bytes']} B)",
                        where=self.storage.display(rel),
                    )
        return local
