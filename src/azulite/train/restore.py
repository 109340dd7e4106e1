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

from azulite.errors import CheckpointCorruptError, CheckpointError
from azulite.train import digest
from azulite.train.digest import IntegrityError
from azulite.train.catalog import MANIFEST, read_manifest, scan_steps, step_dir
from azulite.train.storage import CheckpointStorage, remove_if_empty

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
        self._quarantined: set[str] = set()  # un-committed by this process: said once, when it was

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
                elif rel in self._quarantined:
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
            raise CheckpointCorruptError(
                f"none of the {corrupt} committed checkpoint(s) under {self.storage.uri} is intact",
                where=self.storage.uri,
                fix="the log above names each one's bad file; they were un-committed (manifest.json renamed to "
                    "manifest.corrupt.json): restore the files from a copy and rename the manifests back, or "
                    "train into a new checkpoint location (or delete this one) to start from scratch")
        return None

    def quarantine(self, rel: str) -> None:
        """Un-commit a corrupt checkpoint (manifest.json -> manifest.corrupt.json): it stops counting, the
        evidence stays, and a later save of the same step replaces it."""
        self._quarantined.add(rel)
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
        """Drop this rank's downloaded copy (Blob), and its ``restore-step-N`` folder once no rank on this
        host uses it; local checkpoints are read in place and kept."""
        if self.storage.remote:
            mine = self.restore_dir(step)
            shutil.rmtree(mine, ignore_errors=True)
            remove_if_empty(mine.parent)


# --- what a failed load says ---------------------------------------------------------------------------
_GLOBAL_METADATA = "global metadata read failed: "


def integrity_messages(exc: BaseException) -> list[str]:
    """What was wrong with which file, one message per corrupt file, whole (with the step folder), from
    every rank's failure: an IntegrityError, or torch's AssertionError that joined one into its text (DCP
    reads ``.metadata`` catching every error: a tampered one came back as "metadata is None; global metadata
    read failed: file .metadata does not match the manifest ...", and the message was cut at 300 characters
    in the middle of the folder's path)."""
    failures = getattr(exc, "failures", None)
    inners = [v[0] if isinstance(v, tuple) else v for _, v in sorted(failures.items())] \
        if isinstance(failures, dict) else [exc]
    out: list[str] = []
    for inner in inners:
        text = None
        if isinstance(inner, IntegrityError):
            text = inner.message if not inner.where else f"{inner.message} [{inner.where}]"
        elif isinstance(inner, AssertionError) and _GLOBAL_METADATA in str(inner):
            text = str(inner).split(_GLOBAL_METADATA, 1)[1].split("; rank local metadata read failed", 1)[0]
            if not text.startswith("file .metadata ") or not ("does not match the manifest" in text
                                                              or "is missing" in text):
                text = None
        if text and text not in out:
            out.append(text)
    return out


def state_mismatch(exc: BaseException) -> bool:
    """Whether DCP refused the load because the saved tensors and the script's state disagree (a tensor's
    shape, a key the script has and the checkpoint lacks): torch says so in a ValueError / RuntimeError."""
    failures = getattr(exc, "failures", None)
    inners = [v[0] if isinstance(v, tuple) else v for v in failures.values()] if isinstance(failures, dict) else [exc]
    return any(isinstance(e, (ValueError, RuntimeError)) and not isinstance(e, IntegrityError)
               and ("Size mismatch" in str(e) or "Missing key in checkpoint" in str(e)) for e in inners)


class _IntegrityTracebacks(logging.Filter):
    """DCP logs a failed read of ``.metadata`` on the root logger with its traceback ("Global metadata is not
    found. Falling back to rank local metadata.") before it fails the load with the same text. For a file
    that does not match its manifest the Checkpointer says so itself, one line per file: that record goes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, IntegrityError)
                    and record.getMessage().startswith(("Global metadata is not found", "Rank local metadata")))


logging.getLogger().addFilter(_IntegrityTracebacks())
