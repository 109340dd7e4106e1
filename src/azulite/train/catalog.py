"""What is in a checkpoint location, without torch: the step-numbered layout, the manifest that makes a
checkpoint exist, and the listing ``azulite job show`` / ``job wait`` read (a CLI call must not pay for
importing torch and DCP to list a directory).

    <uri>/step-00000040/   one committed checkpoint: DCP's shards and .metadata, one hashes-rankNNNNN.json
                           per rank, and manifest.json (written last; no valid manifest: no checkpoint)
    <uri>/writer.json      the azulite job writing the location now (a second job saving there is refused)
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from azulite.errors import StorageError
from azulite.train.storage import CheckpointStorage, StorageSettings, first_line, refused

MANIFEST = "manifest.json"
#: at the location's top: the job that writes it now (train/checkpoint.py, Checkpointer._claim)
WRITER = "writer.json"
MANIFEST_FORMAT = "azulite.checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    uri: str
    #: a valid manifest is present (the checkpoint exists); False for an interrupted save
    committed: bool
    bytes: int
    #: the azulite job that committed it (its manifest's ``job_id``; None: not committed, or saved outside one)
    job_id: str | None = None


def read_manifest(storage: CheckpointStorage, rel: str, step: int) -> dict[str, Any] | None:
    """The manifest of step directory ``rel``, or None if it is missing or not a valid one for ``step``."""
    try:
        data = storage.read_bytes(f"{rel}/{MANIFEST}")
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(data)
    except ValueError:
        return None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or manifest.get("step") != step
        or not isinstance(manifest.get("files"), dict)
    ):
        return None
    return manifest


def scan_steps(storage: CheckpointStorage) -> list[tuple[int, str]]:
    """(step, directory name) of every step directory, committed or not, oldest first (a file named like
    one is not: it broke resume and listing with NotADirectoryError)."""
    steps = []
    for name in storage.list_dir(folders_only=True):
        m = _STEP_DIR.match(name)
        if m:
            steps.append((int(m.group(1)), name))
    return sorted(steps)


def list_checkpoints(
    uri: str, *, settings: StorageSettings | None = None, environ: Mapping[str, str] | None = None
) -> list[CheckpointInfo]:
    """Every step directory under ``uri``, oldest first. ``committed`` means a valid manifest (hashes are
    not verified here: that is resume's job). ``bytes`` is the manifest's total for committed ones and
    what is on storage for the others. Any failure to read is a StorageError naming the location."""
    if settings is None:
        settings = StorageSettings.from_environ(os.environ if environ is None else environ)
    storage = CheckpointStorage(uri, settings)
    out = []
    try:
        for step, rel in scan_steps(storage):
            manifest = read_manifest(storage, rel, step)
            if manifest is not None:
                size = sum(int(f.get("bytes", 0)) for f in manifest["files"].values())
            else:
                size = storage.du(rel)
            out.append(CheckpointInfo(step=step, uri=storage.display(rel), committed=manifest is not None, bytes=size,
                                      job_id=manifest.get("job_id") if manifest is not None else None))
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - any SDK, network or OS failure is the same user problem
        if refused(e):
            raise storage.refused_error(e) from None
        raise StorageError(f"cannot list checkpoints under {storage.uri}: {type(e).__name__}: {first_line(e)}",
                           where=storage.uri, fix="check that the storage is reachable and its credentials are set") from None
    return out
