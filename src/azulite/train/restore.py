"""Restore: find the newest checkpoint whose files match their manifest, and give its files to DCP.

A committed checkpoint is trusted only after every file's digest matches the manifest, checked as the
files are read (:mod:`azulite.train.reader`); a corrupt one is un-committed (``manifest.corrupt.json``)
and the previous one is used. From Blob, each rank downloads the files its load plan reads into a
per-rank local directory (parallel ranged GETs) and reads them from there the same way. The collectives
that make every rank load the same step are the Checkpointer's; this module touches only storage.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from azulite.errors import CheckpointError
from azulite.train import digest
from azulite.train.digest import IntegrityError
from azulite.train.catalog import MANIFEST, read_manifest, scan_steps, step_dir
from azulite.train.storage import CheckpointStorage

log = logging.getLogger("azulite.train.checkpoint")


def mismatch(name: str, got: str, got_bytes: int, want: Mapping[str, Any], where: str) -> IntegrityError:
    algorithm = digest.algorithm_of(want)
    return IntegrityError(f"file {name} does not match the manifest ({algorithm} {got[:12]}.. {got_bytes} B, "
                          f"expected {want[algorithm][:12]}.. {want['bytes']} B) [{where}]")


class Restorer:
    """One rank's view of a checkpoint location: which checkpoint to load, and where its files are read
    from (``staging`` holds this rank's Blob downloads)."""

    def __init__(self, storage: CheckpointStorage, *, rank: int, staging: Path, threads: int) -> None:
        self.storage = storage
        self.rank = rank
        self.staging = staging
        self.threads = threads

    def choose(self) -> tuple[int, dict[str, Any]] | None:
        """The newest committed checkpoint whose files are all there with their manifest sizes (step,
        manifest); None when there is none. Raises CheckpointError when there are committed checkpoints
        and none of them is whole. Every byte's hash is checked as it is read
        (:class:`azulite.train.reader.VerifyingReader`): reading a checkpoint twice, once to hash it
        and once to load it, made a restore cost two reads (and for Blob, every rank a download of all
        ranks' files)."""
        corrupt = 0
        for step, rel in reversed(scan_steps(self.storage)):
            manifest = read_manifest(self.storage, rel, step)
            if manifest is None:
                if self.storage.exists(f"{rel}/{MANIFEST}"):
                    # there but not a manifest of this step: the manifest is written whole (an atomic link)
                    # or not at all, so this is damage, not an interrupted save (it was taken for one: the
                    # run started over, and its saves then removed the good shards)
                    log.warning("checkpoint step %d is corrupt: its %s is not a valid manifest; falling back to "
                                "the previous one", step, MANIFEST)
                    self.quarantine(rel)
                    corrupt += 1
                elif self.storage.exists(f"{rel}/manifest.corrupt.json"):
                    log.warning("ignoring %s: found corrupt earlier", self.storage.display(rel))
                    corrupt += 1
                else:
                    log.warning("ignoring %s: no valid %s (an interrupted save)", self.storage.display(rel), MANIFEST)
                continue
            try:
                self.check_sizes(step, manifest)
            except CheckpointError as e:
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
        """Every file of the checkpoint is there with the manifest's size (a stat each, or one Blob listing)."""
        rel = step_dir(step)
        sizes = self.storage.sizes(rel)
        for name, want in manifest["files"].items():
            size = sizes.get(name)
            if size is None:
                raise IntegrityError(f"file {name} is missing", where=self.storage.display(rel))
            if size != want["bytes"]:
                raise IntegrityError(f"file {name} is {size} B, the manifest says {want['bytes']} B",
                                     where=self.storage.display(rel))

    def restore_dir(self, step: int) -> Path:
        """Where DCP reads checkpoint ``step`` from on this rank."""
        if self.storage.remote:
            return self.staging / f"restore-{step_dir(step)}" / f"rank-{self.rank}"
        return Path(self.storage.path(step_dir(step)))

    def fetcher(self, step: int) -> Callable[[str, Path], None] | None:
        """For Blob: downloads one file of checkpoint ``step`` to a local path (ranged GETs in parallel),
        for :class:`~azulite.train.reader.VerifyingReader` to fetch the files this rank's load plan
        reads, and only those. None for a local checkpoint (read in place)."""
        if not self.storage.remote:
            return None
        rel = step_dir(step)

        def fetch(name: str, local: Path) -> None:
            try:
                self.storage.download(f"{rel}/{name}", local)
            except FileNotFoundError:
                raise IntegrityError(f"file {name} is missing", where=self.storage.display(rel)) from None

        return fetch

    def discard(self, step: int) -> None:
        """Drop this rank's downloaded copy (Blob); local checkpoints are read in place and kept."""
        if self.storage.remote:
            shutil.rmtree(self.restore_dir(step), ignore_errors=True)
