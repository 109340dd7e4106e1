"""Which checkpoint an export reads, and its files, verified: a step directory (``.../step-00000040``) or a
checkpoint location (the newest committed step, or ``step``), on local disk or Blob (``az://``).

Export refuses what resume would refuse: a step without a valid manifest (an interrupted save, or a corrupt
one) and files whose size or digest differ from the manifest. It never falls back to an older step on its
own: exporting something other than what was asked for would be a silent surprise; the error names the
steps there are.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from azulite.errors import CheckpointError, CheckpointUsageError, ExportError, StorageError
from azulite.train import digest
from azulite.train.catalog import MANIFEST, read_manifest, scan_steps, step_dir
from azulite.train.storage import CheckpointStorage, StorageSettings, first_line, refused

_STEP = re.compile(r"^step-(\d{8,})$")


@dataclass(frozen=True)
class CheckpointRef:
    storage: CheckpointStorage
    step: int
    manifest: dict[str, Any]
    #: the user named this step's folder (not a location): "export another step (--step)" is no fix then
    named_step: bool = False

    @property
    def rel(self) -> str:
        return step_dir(self.step)

    @property
    def display(self) -> str:
        return self.storage.display(self.rel)


def resolve(uri: str, *, step: int | None = None, environ: Mapping[str, str] | None = None) -> CheckpointRef:
    """The committed checkpoint ``uri`` names (a step directory), or the newest (or ``step``) under it."""
    settings = StorageSettings.from_environ(os.environ if environ is None else environ)
    head, _, last = uri.rstrip("/").rpartition("/")
    m = _STEP.match(last)
    named_step = bool(m and head)
    if named_step:
        if step is not None and step != int(m.group(1)):
            raise ExportError(f"--step {step} contradicts the step directory {last} in the URI", where=uri,
                              fix=f"drop --step, or pass the checkpoint location {head} with --step {step}")
        step = int(m.group(1))
        uri = head
    storage = CheckpointStorage(uri, settings)
    try:
        steps = scan_steps(storage)
        if step is None:
            committed = [(s, rel) for s, rel in reversed(steps) if read_manifest(storage, rel, s) is not None]
            if not committed and not steps and storage.exists(MANIFEST):
                raise ExportError(_misnamed_step(storage), where=storage.uri,
                                  fix=f"rename the folder {_step_name(storage)} (export reads a step by its folder's "
                                      "name, as resume does), or pass the checkpoint location holding it")
            if not committed:  # a location given wrongly, or too early: the user's to fix (exit 2)
                what = f"{len(steps)} step director{'y' if len(steps) == 1 else 'ies'}, none committed" if steps else "no step directories"
                raise CheckpointUsageError(f"no committed checkpoint under {storage.uri} ({what})", where=storage.uri,
                                           fix="export a job after its first checkpoint is committed "
                                               "(azulite job wait ID --checkpoint)")
            step = committed[0][0]
        rel = step_dir(step)
        manifest = read_manifest(storage, rel, step)
    except (CheckpointError, StorageError, ExportError):  # CheckpointUsageError too
        raise
    except Exception as e:  # noqa: BLE001 - any SDK/network/OS failure is the same user problem
        if refused(e):  # credentials wrong as given: the user's to fix (exit 2), not storage that is down
            raise storage.refused_error(e) from None
        raise StorageError(f"cannot read checkpoints under {storage.uri}: {type(e).__name__}: {first_line(e)}",
                           where=storage.uri, fix="check that the storage is reachable and its credentials are set") from None
    if manifest is None:
        known = [s for s, _ in steps]
        if step not in known:  # a usage error (exit 2), naming the steps that can be exported
            committed = [s for s, rel in steps if read_manifest(storage, rel, s) is not None]
            listed = ", ".join(map(str, committed))
            raise ExportError(f"no checkpoint step {step} under {storage.uri} (committed steps there: "
                              f"{listed or 'none'})", where="--step",
                              fix=f"pass one of them, e.g. --step {committed[-1]}, or omit --step for the newest"
                              if committed else "export after the job's first checkpoint is committed "
                                                "(azulite job wait ID --checkpoint)")
        # resume's words: a manifest that is there but not valid is damage (it is written whole or not at all:
        # exit 1, like a file that fails its hash); none at all, an interrupted save (not a checkpoint: exit 2)
        fix = (f"export a committed step folder of {storage.uri}, or {storage.uri} itself for its newest committed "
               "step" if named_step else "export a committed step (omit --step for the newest one)")
        if storage.exists(f"{rel}/manifest.corrupt.json"):
            raise CheckpointError(f"checkpoint {storage.display(rel)} is corrupt: a resume found it so and "
                                  "un-committed it (manifest.corrupt.json)", where=storage.display(rel), fix=fix)
        if storage.exists(f"{rel}/{MANIFEST}"):
            raise CheckpointError(f"checkpoint {storage.display(rel)} is corrupt: its {MANIFEST} is not a valid "
                                  "manifest", where=storage.display(rel), fix=fix)
        raise CheckpointUsageError(f"checkpoint {storage.display(rel)} is not committed: it has no {MANIFEST}: an "
                                   "interrupted save", where=storage.display(rel), fix=fix)
    return CheckpointRef(storage=storage, step=step, manifest=manifest, named_step=named_step)


def _step_name(storage: CheckpointStorage) -> str:
    """``step-00000040`` for a folder whose manifest says step 40 (``step-NNNNNNNN`` when it does not say)."""
    try:
        step = json.loads(storage.read_bytes(MANIFEST)).get("step")
    except Exception:  # noqa: BLE001 - unreadable or not JSON: the name's form is still the answer
        step = None
    return step_dir(step) if isinstance(step, int) and step >= 0 else "step-NNNNNNNN (its step, 8 digits)"


def _misnamed_step(storage: CheckpointStorage) -> str:
    name = storage.uri.rstrip("/").rpartition("/")[2]
    return (f"this folder holds a {MANIFEST} but is not a checkpoint step folder: {name!r} is not named "
            "step-NNNNNNNN (and it holds no step folders)")


def fetch_verified(ref: CheckpointRef, staging: Path) -> Path:
    """A local directory holding the checkpoint's files, each checked against the manifest (size and
    digest). Local checkpoints are read in place; Blob ones are downloaded under ``staging``."""
    files: dict[str, Any] = ref.manifest["files"]
    damaged = ("the checkpoint is damaged: restore its files from a copy, or export another committed step "
               f"folder of {ref.storage.uri}" if ref.named_step else "the checkpoint is damaged: export another "
               "step (--step)")
    if ref.storage.remote:
        local = staging / ref.rel
        for name in sorted(files):
            try:
                ref.storage.download(f"{ref.rel}/{name}", local / name)
            except FileNotFoundError:
                raise CheckpointError(f"file {name} listed in the manifest is missing", where=ref.display,
                                      fix=damaged) from None
            except Exception as e:  # noqa: BLE001 - any SDK/network failure is the same user problem
                if refused(e):
                    raise ref.storage.refused_error(e) from None
                raise StorageError(f"cannot download {name}: {type(e).__name__}: {first_line(e)}",
                                   where=ref.display, fix="check that the storage is reachable and its "
                                                          "credentials are set, then export again") from None
    else:
        local = Path(ref.storage.path(ref.rel))
    for name, want in sorted(files.items()):
        path = local / name
        if not path.is_file():
            raise CheckpointError(f"file {name} listed in the manifest is missing", where=ref.display,
                                  fix=damaged)
        algorithm = digest.algorithm_of(want)
        got = digest.file_entry(path, algorithm)
        if got != {algorithm: want[algorithm], "bytes": want.get("bytes")}:
            raise CheckpointError(
                f"file {name} does not match the manifest ({algorithm} {got[algorithm][:12]}.. {got['bytes']} B, "
                f"expected {str(want[algorithm])[:12]}.. {want.get('bytes')} B)",
                where=ref.display, fix=damaged)
    return local
