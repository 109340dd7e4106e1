"""Writing into a Triton model repository without ever showing a half-written model.

Each model is assembled in a hidden staging folder inside the repository (same filesystem; the server
skips hidden entries) and moved into place with rename(2): a new model appears whole (with its
config.pbtxt), a new version folder appears whole beside the others. A server polling the repository, or
asked to load through the load API, picks the new version up without a restart.

A new version of an existing model keeps the model's config.pbtxt as it is: Triton has ONE config per
model, shared by all its versions (one platform/backend, one signature, one batching), and it may carry
the user's own settings (version_policy, instance_group, ...). So the new version must fit it: the same
format (a TorchScript version beside ONNX ones would not load under ``version_policy: all`` or a
rollback), the same inputs and outputs, the same max_batch_size; otherwise the export is refused before
anything is written, and the error names the fix (another ``--name``, or the model's own ``--format``).
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
from azulite.errors import AzuliteError, ExportError
from azulite.serve import config as serve_config
from azulite.serve.proto import model_config_pb2 as mc
from azulite.serve.repository import version_dirs

#: serve_config.backend_of(config) -> the export format that writes it
FORMAT_OF_BACKEND = {"onnxruntime": "onnx", "pytorch": "torchscript", "python": "python", "ensemble": "ensemble"}


@dataclass(frozen=True)
class Staged:
    """A model being written: put the version's files in ``version_dir`` and config.pbtxt in ``root``."""

    name: str
    version: int
    root: Path

    @property
    def version_dir(self) -> Path:
        return self.root / str(self.version)


@dataclass(frozen=True)
class ExistingModel:
    """A model already in the repository: its config.pbtxt (as written, defaults not filled in), the export
    format that config serves (None: a backend export never writes) and its version folders."""

    name: str
    path: Path
    config: mc.ModelConfig
    format: str | None
    versions: tuple[int, ...]

    @property
    def config_path(self) -> Path:
        return self.path / "config.pbtxt"

    def describe(self) -> str:
        what = self.config.platform or f'backend "{self.config.backend}"'
        versions = ", ".join(map(str, self.versions)) or "none yet"
        return f"model '{self.name}' in {self.path.parent} is {self.format or 'served by ' + what} ({what}; versions {versions})"


def existing_model(repo: Path, name: str) -> ExistingModel | None:
    """The model ``name`` already in ``repo``, or None if there is none (no folder, or an empty one)."""
    model_dir = repo / name
    if not model_dir.is_dir():
        return None
    versions = version_dirs(model_dir)
    config_path = model_dir / "config.pbtxt"
    if not config_path.is_file():
        if not versions:
            return None
        raise ExportError(f"{model_dir} holds versions {', '.join(map(str, versions))} but no config.pbtxt: "
                          "the new version could not tell which format and signature they share",
                          where=str(model_dir),
                          fix=f"export under another name (--name), or write its config.pbtxt first "
                              f"(azulite config generate {model_dir}/{versions[-1]}/MODEL_FILE -o {config_path})")
    try:
        config = serve_config.parse_config_file(config_path, model=name)
    except AzuliteError as e:
        raise ExportError(f"cannot read the existing {config_path}: {e.message}", where=str(config_path),
                          fix="fix that config.pbtxt, or export under another name (--name)") from None
    return ExistingModel(name=name, path=model_dir, config=config,
                         format=FORMAT_OF_BACKEND.get(serve_config.backend_of(config)), versions=versions)


def formats_for(existing: ExistingModel | None, requested: str, writable: tuple[str, ...],
                hint_name: str) -> tuple[str, ...]:
    """The formats to try, in order, for ``requested`` ("auto" or one of ``writable``, the formats this
    export can write): for a new model ``requested`` (auto: all of them); for an existing one only its own
    format (``auto`` narrows to it, another format is refused)."""
    if existing is None:
        return writable if requested == "auto" else (requested,)
    if existing.format not in writable:
        raise ExportError(f"{existing.describe()}: an export cannot add a version to it",
                          where=str(existing.config_path), fix=f"export under another name (--name {hint_name}_new)")
    if requested not in ("auto", existing.format):
        raise ExportError(
            f"{existing.describe()}; a {requested} version cannot join them: Triton serves all versions of a "
            f"model under one config.pbtxt, with one platform/backend, so a {requested} version (or the older "
            f"ones, under version_policy all or a rollback) would not load",
            where=str(existing.config_path),
            fix=f"export under another name (--name {hint_name}_{requested}), or as the model's own format "
                f"(--format {existing.format}, or omit --format)")
    return (existing.format,)


def check_fits(existing: ExistingModel, new: mc.ModelConfig, hint_name: str) -> None:
    """The new version's config must be the existing one in what every version shares: format (checked
    before exporting), inputs, outputs and max_batch_size. Tensors the existing config leaves out (Triton
    auto-completes them) and -1 dims in it accept anything."""
    problems = []
    old = existing.config
    if old.max_batch_size != new.max_batch_size:
        problems.append(f"max_batch_size {new.max_batch_size}, the model's config.pbtxt has {old.max_batch_size}")
    for kind, old_tensors, new_tensors in (("input", old.input, new.input), ("output", old.output, new.output)):
        if not old_tensors:
            continue
        have = {t.name: t for t in old_tensors}
        want = {t.name: t for t in new_tensors}
        if sorted(have) != sorted(want):
            problems.append(f"{kind}s {sorted(want)}, the model's config.pbtxt has {sorted(have)}")
            continue
        for tname, t in want.items():
            o = have[tname]
            if o.data_type != t.data_type:
                problems.append(f"{kind} {tname} is {mc.DataType.Name(t.data_type)}, the config says "
                                f"{mc.DataType.Name(o.data_type)}")
            elif len(o.dims) != len(t.dims) or any(a != b and -1 not in (a, b) for a, b in zip(o.dims, t.dims)):
                problems.append(f"{kind} {tname} has dims {list(t.dims)}, the config says {list(o.dims)}")
    if problems:
        only_batching = len(problems) == 1 and problems[0].startswith("max_batch_size")
        fix = (f"omit --max-batch-size (the model's {old.max_batch_size} is used), or export under another name "
               f"(--name {hint_name}_b{new.max_batch_size})" if only_batching
               else f"a changed signature is a new model: export under another name (--name {hint_name}_v2)")
        raise ExportError(f"the new version does not fit {existing.describe()}: " + "; ".join(problems)
                          + ". All versions of a model share its one config.pbtxt",
                          where=str(existing.config_path), fix=fix)


def next_version(repo: Path, name: str) -> int:
    model_dir = repo / name
    return (max(version_dirs(model_dir)) + 1) if model_dir.is_dir() and version_dirs(model_dir) else 1


def check_model_name(name: str) -> None:
    if not name or "/" in name or name.startswith(".") or name in (".", ".."):
        raise ExportError(f"model name {name!r} is not a folder name", fix="pass --name NAME (letters, digits, _ -)")


@contextmanager
def stage(repo: Path, name: str, version: int | None) -> Iterator[Staged]:
    """Yields a staging area; on a clean exit moves it into ``repo/name`` (a new model, or a new version of
    it), on an exception deletes it: nothing half-written ever lands in the repository. Write config.pbtxt
    into it only for a new model (an existing model's config is kept: see the module's docstring)."""
    check_model_name(name)
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
        if (staging / "config.pbtxt").exists() and (model_dir / "config.pbtxt").exists():
            # checked as new, but another writer created the model meanwhile: its config stays, so must ours
            raise ExportError(f"model {name} appeared in {repo} while exporting", fix="export again")
        os.rename(staged.version_dir, model_dir / str(version))
        if (staging / "config.pbtxt").exists():  # a model folder that held no config and no versions
            os.rename(staging / "config.pbtxt", model_dir / "config.pbtxt")
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
