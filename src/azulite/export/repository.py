"""Writing into a Triton model repository without ever showing a half-written model.

Each model is assembled in a hidden staging folder inside the repository (same filesystem; the server
skips hidden entries) and moved into place with rename(2): a new model appears whole, a new version
folder appears whole and then its config.pbtxt replaces the old one (os.replace). A server polling the
repository, or asked to load through the load API, picks the new version up without a restart.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from azulite import integrity
from azulite.errors import ExportError
from azulite.serve.repository import version_dirs


@dataclass(frozen=True)
class Staged:
    """A model being written: put the version's files in ``version_dir`` and config.pbtxt in ``root``."""

    name: str
    version: int
    root: Path

    @property
    def version_dir(self) -> Path:
        return self.root / str(self.version)


def next_version(repo: Path, name: str) -> int:
    model_dir = repo / name
    return (max(version_dirs(model_dir)) + 1) if model_dir.is_dir() and version_dirs(model_dir) else 1


@contextmanager
def stage(repo: Path, name: str, version: int | None) -> Iterator[Staged]:
    """Yields a staging area; on a clean exit moves it into ``repo/name`` (a new model, or a new version of
    it), on an exception deletes it: nothing half-written ever lands in the repository."""
    if not name or "/" in name or name.startswith(".") or name in (".", ".."):
        raise ExportError(f"model name {name!r} is not a folder name", fix="pass --name NAME (letters, digits, _ -)")
    repo.mkdir(parents=True, exist_ok=True)
    model_dir = repo / name
    if model_dir.exists() and not model_dir.is_dir():
        raise ExportError(f"{model_dir} exists and is not a model folder", where=str(repo))
    if version is None:
        version = next_version(repo, name)
    elif version < 1:
        raise ExportError(f"version {version} must be >= 1 (Triton ignores version folder 0)", fix="e.g. --version 1")
    elif (model_dir / str(version)).exists():
        raise ExportError(f"{name} version {version} already exists in {repo}",
                          fix=f"omit --version to write the next one ({next_version(repo, name)}), or remove {model_dir / str(version)}")
    staging = repo / f".azulite-export-{name}-{uuid.uuid4().hex[:12]}"
    staged = Staged(name=name, version=version, root=staging)
    staged.version_dir.mkdir(parents=True)
    try:
        yield staged
        _fsync_tree(staging)
        if not model_dir.exists():
            os.rename(staging, model_dir)
            return
        if (model_dir / str(version)).exists():  # another export won the race for this version
            raise ExportError(f"{name} version {version} appeared in {repo} while exporting", fix="export again")
        os.rename(staged.version_dir, model_dir / str(version))
        if (staging / "config.pbtxt").exists():
            os.replace(staging / "config.pbtxt", model_dir / "config.pbtxt")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    """File contents on disk before the rename publishes them (a crash must not leave empty files)."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def check_integrity_before(repo: Path, sign_key: Path | None) -> None:
    """Before anything is written: an export into a repository with an integrity manifest must be able to
    update it (and re-sign it when it is signed), or it fails here, leaving the repository as it was."""
    if (repo / integrity.SIGNATURE).is_file() and sign_key is None:
        raise ExportError(f"{repo}'s integrity manifest is signed: exporting into it must re-sign it",
                          where=str(repo / integrity.SIGNATURE), fix="pass the signing key: --sign-key PRIVATE.pem")


def update_integrity(repo: Path, written: list[Path], sign_key: Path | None = None) -> str | None:
    """The export's single call site for the repository's integrity manifest (azulite.integrity): after
    every model of an export is in place, re-hash the folders written and re-sign. A repository without a manifest gets one only when a signing key is given. Returns what was done, or None."""
    if not integrity.has_manifest(repo) and sign_key is None:
        return None
    names = [p.relative_to(repo).as_posix() for p in written]
    integrity.update_manifest(repo, names, private_key=sign_key)
    return f"{integrity.MANIFEST} updated for {', '.join(names)}" + (" and re-signed" if sign_key else "")
